// A torch.save() archive: zip container and pickle, then map to nn.MultiheadAttention weights.
#include <string>

#include "server/weights/torch_archive.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto tensors = attnserve::ParseTorchArchive(bytes, "fuzz.pt");
  if (tensors.ok()) {
    attnserve::ModelConfig config;
    config.num_heads = 2;
    (void)attnserve::CanonicalizeWeights(tensors.value(), config, "fuzz.pt");
  }
  return 0;
}
