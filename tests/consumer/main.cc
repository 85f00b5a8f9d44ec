// Sends one self-attention request to the demo model at argv[1]; exit 0 when the answer is right.
#include <attnserve/client.h>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  attnserve::ClientOptions options;
  options.target = argv[1];
  attnserve::Client client(options);
  attnserve::AttendRequest request;
  request.model = "demo";
  request.query = attnserve::Tensor::Float32({1, 3, 512}, std::vector<float>(3 * 512, 0.5f));
  attnserve::AttendResult result;
  const attnserve::CallStatus status = client.Attend(request, &result);
  if (!status.ok()) {
    std::fprintf(stderr, "consumer: %s\n", status.ToString().c_str());
    return 1;
  }
  const bool shape_ok = result.output.shape == std::vector<int64_t>{1, 3, 512};
  std::printf("consumer: output [%lld, %lld, %lld] from %s\n",
              static_cast<long long>(result.output.shape[0]),
              static_cast<long long>(result.output.shape[1]),
              static_cast<long long>(result.output.shape[2]), result.model.c_str());
  return shape_ok ? 0 : 1;
}
