#include "server/metrics.h"

namespace attnserve {
namespace {

// 100 µs to ~26 s, factor 2: spans a tiny CPU forward up to a long queue wait.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* kBuckets = [] {
    auto* b = new prometheus::Histogram::BucketBoundaries;
    for (double v = 1e-4; v < 30; v *= 2) b->push_back(v);
    return b;
  }();
  return *kBuckets;
}

const prometheus::Histogram::BucketBoundaries& BatchBuckets() {
  static const auto* kBuckets = new prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128};
  return *kBuckets;
}

}  // namespace

ServerMetrics::ServerMetrics(prometheus::Registry& registry)
    : latency_(prometheus::BuildHistogram()
                   .Name("attnserve_request_duration_seconds")
                   .Help("Time from receiving a request to its answer, at the RPC boundary.")
                   .Register(registry)),
      requests_(prometheus::BuildCounter()
                    .Name("attnserve_requests_total")
                    .Help("Requests answered, by model, method and gRPC status code.")
                    .Register(registry)),
      in_flight_(prometheus::BuildGauge()
                     .Name("attnserve_requests_in_flight")
                     .Help("Requests received and not yet answered.")
                     .Register(registry)),
      queue_(prometheus::BuildHistogram()
                 .Name("attnserve_queue_wait_seconds")
                 .Help("Time a request waited between acceptance and the start of compute.")
                 .Register(registry)),
      compute_(prometheus::BuildHistogram()
                   .Name("attnserve_compute_seconds")
                   .Help("Engine time of the batch a request was computed in.")
                   .Register(registry)),
      batch_size_(prometheus::BuildHistogram()
                      .Name("attnserve_batch_size_requests")
                      .Help("Requests computed together in one engine call.")
                      .Register(registry)),
      model_info_(prometheus::BuildGauge()
                      .Name("attnserve_model_info")
                      .Help("A loaded model (value 1), described by its labels.")
                      .Register(registry)) {}

void ServerMetrics::RecordRequest(const std::string& model, const std::string& method,
                                  const std::string& code, double seconds) {
  const prometheus::Labels labels{{"model", model}, {"method", method}, {"code", code}};
  latency_.Add(labels, LatencyBuckets()).Observe(seconds);
  requests_.Add(labels).Increment();
}

void ServerMetrics::AddInFlight(const std::string& method, double delta) {
  in_flight_.Add({{"method", method}}).Increment(delta);
}

void ServerMetrics::RecordCompute(const std::string& model, double queue_seconds,
                                  double compute_seconds, int batch_size) {
  queue_.Add({{"model", model}}, LatencyBuckets()).Observe(queue_seconds);
  compute_.Add({{"model", model}}, LatencyBuckets()).Observe(compute_seconds);
  batch_size_.Add({{"model", model}}, BatchBuckets()).Observe(batch_size);
}

void ServerMetrics::AddModelInfo(const ModelSpec& s) {
  model_info_
      .Add({{"model", s.name},
            {"embed_dim", std::to_string(s.embed_dim)},
            {"num_heads", std::to_string(s.num_heads)},
            {"kdim", std::to_string(s.kdim)},
            {"vdim", std::to_string(s.vdim)},
            {"device", s.device},
            {"compute_dtype", DTypeName(s.compute_dtype)},
            {"weights_hash", s.weights_hash}})
      .Set(1);
}

}  // namespace attnserve
