// attnserve-bench: load generator for attnserve (through the C++ client library) or for the engine
// in-process (the compute floor, no gRPC). Closed loop (N callers) or open loop (fixed rate);
// fixed, uniform or long-tail lengths; self- or cross-attention. Prints throughput and latency
// percentiles, a progress line while running, and writes JSON.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "attnserve/client.h"
#include "attnserve/shared_memory.h"
#include "client/cli/client_flags.h"
#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/engine/device_support.h"
#include "server/models/model_loader.h"
#include "server/pipeline/batcher.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  double latency_ms;
  int code;
  int64_t tokens;
  double flops;
  double end_s;  // When the answer came, in seconds of the system clock (common to processes).
};

// One prepared request: the client's form, plus views for the in-process engine.
struct Prepared {
  attnserve::AttendRequest request;
  int64_t tokens = 0;
  double flops = 0;  // Projections + QK^T + PV, as the server's ForwardFlops counts them.
};

// Where requests go. `done(code)` runs once per call, on any thread.
class Backend {
 public:
  virtual ~Backend() = default;
  /// `caller` is the closed-loop caller's index (0 in open loop).
  virtual void Call(int caller, const Prepared& p, std::function<void(int)> done) = 0;
  /// Where the model computes ("cpu", "cuda:0"): the engine's, or the server's as GetModel says.
  virtual std::string Device() = 0;
};

// Closed-loop requests whose tensors lie in shared memory on this host (--shared-memory): the
// pool's queries, keys and values in one registered region, each caller's answer written by the
// server into a region of its own. What a client on the server's host sends instead of bytes. One
// region per caller for the answers: the server writes a region through its file (pwrite), and the
// kernel lets one write at a time into a file (its inode lock), so answers written into one shared
// region queue behind each other (an H200 run, 2026-11-28: 1.9 ms a 2.3 MB answer, 0.17x the
// engine).
class SharedPool {
 public:
  SharedPool(attnserve::Client& client, const std::vector<Prepared>& pool, int callers) {
    size_t in = 0, out = 0;
    for (const Prepared& p : pool) {
      in += p.request.query.data.size() +
            (p.request.key ? p.request.key->data.size() + p.request.value->data.size() : 0);
      out = std::max(out, p.request.query.data.size());
    }
    const std::string tag = std::to_string(::getpid());
    inputs_ = attnserve::SharedMemoryRegion::Create("/attnserve-bench-in-" + tag, in);
    const auto enroll = [&](const std::string& name, const attnserve::SharedMemoryRegion& r) {
      client.UnregisterSharedMemory(name);
      const attnserve::CallStatus s = client.RegisterSharedMemory(name, r.key(), 0, r.size());
      if (!s.ok()) throw std::invalid_argument("--shared-memory: " + s.ToString());
    };
    enroll("bench-in", *inputs_);
    for (int c = 0; c < callers; ++c) {
      outputs_.push_back(attnserve::SharedMemoryRegion::Create(
          "/attnserve-bench-out-" + tag + "-" + std::to_string(c), out));
      enroll("bench-out-" + std::to_string(c), *outputs_.back());
    }
    size_t at = 0;
    for (const Prepared& p : pool) {
      attnserve::AttendRequest r = p.request;
      r.query = inputs_->Put(p.request.query, "bench-in", at);
      at += p.request.query.data.size();
      if (p.request.key) {
        r.key = inputs_->Put(*p.request.key, "bench-in", at);
        at += p.request.key->data.size();
        r.value = inputs_->Put(*p.request.value, "bench-in", at);
        at += p.request.value->data.size();
      }
      requests_.emplace(&p, std::move(r));
    }
  }
  // `p` with its tensors in the region and its answer into `caller`'s slot.
  attnserve::AttendRequest For(int caller, const Prepared& p) const {
    attnserve::AttendRequest r = requests_.at(&p);
    r.output_shared_memory =
        attnserve::SharedMemoryRef{"bench-out-" + std::to_string(caller), 0,
                                   static_cast<int64_t>(p.request.query.data.size())};
    return r;
  }

 private:
  std::unique_ptr<attnserve::SharedMemoryRegion> inputs_;
  std::vector<std::unique_ptr<attnserve::SharedMemoryRegion>> outputs_;  // One per caller.
  std::map<const Prepared*, attnserve::AttendRequest> requests_;
};

class ClientBackend : public Backend {
 public:
  // With `streams` > 0 each caller sends on its own AttendStream, one request at a time.
  // With `shared` the requests' tensors lie in shared memory (a closed loop of `callers`).
  ClientBackend(attnserve::ClientOptions o, int streams, std::string model,
                const std::vector<Prepared>* shared = nullptr, int callers = 0,
                attnserve::CallOptions call = {})
      : model_(std::move(model)), call_(std::move(call)) {
    o.deadline = std::chrono::milliseconds(120000);
    client_ = std::make_unique<attnserve::Client>(o);
    if (shared) shared_ = std::make_unique<SharedPool>(*client_, *shared, callers);
    pending_.resize(static_cast<size_t>(streams));
    for (int i = 0; i < streams; ++i) {
      streams_.push_back(client_->OpenStream(
          [this, i](attnserve::CallStatus s, attnserve::AttendResult) {
            std::function<void(int)> done;
            {
              std::lock_guard<std::mutex> lock(mu_);
              done = std::move(pending_[static_cast<size_t>(i)]);
            }
            done(s.code);
          },
          call_));
    }
  }
  ~ClientBackend() override {
    for (auto& s : streams_) s->Finish();
  }
  void Call(int caller, const Prepared& p, std::function<void(int)> done) override {
    if (streams_.empty()) {
      client_->AttendAsync(
          shared_ ? shared_->For(caller, p) : p.request,
          [done = std::move(done)](attnserve::CallStatus s, attnserve::AttendResult) {
            done(s.code);
          },
          call_);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_[static_cast<size_t>(caller)] = done;
    }
    if (!streams_[static_cast<size_t>(caller)]->Send(p.request)) done(14);
  }
  std::string Device() override {
    attnserve::ModelInfo info;
    const attnserve::CallStatus s = client_->GetModel(model_, &info);
    // A peer that does not say (no GetModel, or an error with a traceback in it) is named by the
    // status code alone: the row's label stays one line.
    return s.ok() ? info.device
                  : "unknown (GetModel: " + std::string(attnserve::StatusCodeName(s.code)) + ")";
  }

 private:
  const std::string model_;
  const attnserve::CallOptions call_;  // Every call's metadata (--tenant).
  std::unique_ptr<attnserve::Client> client_;
  std::unique_ptr<SharedPool> shared_;
  std::vector<std::unique_ptr<attnserve::AttendStream>> streams_;
  std::mutex mu_;
  std::vector<std::function<void(int)>> pending_;
};

// The engine with no gRPC. Without batching, `workers` threads call it directly, one request at a
// time; like the server's workers, an idle one takes pieces of the request another is computing
// when nothing is queued (attnserve::PieceExchange), so a lone caller gets the same cores here as
// through the server. With batching (--batching), the server's own Batcher with its device
// defaults forms the batches: the server without gRPC. On CUDA the requests' bytes lie in pinned
// staging, as a server decodes them, so the engine copies them straight to the device.
class EngineBackend : public Backend {
 public:
  EngineBackend(int workers, bool batching, const std::string& models_dir, const std::string& name,
                const attnserve::EngineOptions& options, const std::vector<Prepared>& pool)
      : idle_(workers),
        pieces_([this] { return queued_.load() > 0 ? 1 : 1 + idle_.load(); },
                [this] {
                  std::lock_guard<std::mutex> lock(mu_);
                  cv_.notify_all();
                }) {
    attnserve::ModelWeights weights;
    if (models_dir.empty()) {
      weights = attnserve::DemoModelWeights();
    } else {
      auto loaded = attnserve::LoadModel(models_dir + "/" + name, name);
      if (!loaded.ok()) throw std::runtime_error(loaded.status().message());
      weights = std::move(loaded).value();
    }
    auto model = attnserve::CreateTorchModel(weights, options);
    if (!model.ok()) throw std::runtime_error(model.status().message());
    model_ = std::move(model).value();
    Stage(pool, options);
    if (batching) {
      attnserve::BatcherOptions b;
      b.workers = workers;
      b = b.ForDevice(options.device, {false, false, false, true});
      batcher_ = std::make_unique<attnserve::Batcher>(b);
      return;
    }
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~EngineBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    if (batcher_) batcher_->Drain();
  }
  std::string Device() override { return model_->spec().device; }
  void Call(int, const Prepared& p, std::function<void(int)> done) override {
    if (batcher_) {
      auto item = std::make_unique<attnserve::WorkItem>();
      item->model = model_;
      item->call = calls_.at(&p);
      item->accepted = attnserve::SteadyClock::now();
      auto out = std::make_shared<std::string>();
      item->outputs.output = out.get();
      item->done = [out, done = std::move(done)](const attnserve::Status& st,
                                                 const attnserve::WorkItem&) {
        done(st.ok() ? 0 : static_cast<int>(st.code()));
      };
      batcher_->Submit(std::move(item));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(&p, std::move(done));
      queued_ = queue_.size();
    }
    cv_.notify_one();
  }

 private:
  // Each prepared request as the engine's validated call; on CUDA over pinned copies of its bytes.
  void Stage(const std::vector<Prepared>& pool, const attnserve::EngineOptions& options) {
    const bool cuda = options.device.rfind("cuda", 0) == 0;
    size_t bytes = 0;
    for (const Prepared& p : pool) {
      bytes += p.request.query.data.size() + 64;
      if (p.request.key) bytes += p.request.key->data.size() + p.request.value->data.size() + 128;
    }
    attnserve::HostStaging staging(static_cast<int64_t>(bytes), /*pinned=*/true);
    const auto view = [&](const attnserve::Tensor& t) {
      attnserve::TensorView v = View(t);
      char* data = nullptr;
      if (cuda) {
        if (auto block = staging.Allocate(t.data.size(), &data)) {
          std::memcpy(data, t.data.data(), t.data.size());
          v.data = data;
          v.pinned = true;
          blocks_.push_back(std::move(block));
        }
      }
      return v;
    };
    for (const Prepared& p : pool) {
      attnserve::AttendCall call;
      call.query = view(p.request.query);
      if (p.request.key) {
        call.key = view(*p.request.key);
        call.value = view(*p.request.value);
      }
      const attnserve::Status st = attnserve::Validate(model_->spec(), {}, &call);
      if (!st.ok()) throw std::runtime_error("a prepared request: " + st.message());
      calls_.emplace(&p, std::move(call));
    }
  }
  static attnserve::TensorView View(const attnserve::Tensor& t) {
    const attnserve::DType dtype =
        t.dtype == attnserve::DataType::kBFloat16  ? attnserve::DType::kBFloat16
        : t.dtype == attnserve::DataType::kFloat16 ? attnserve::DType::kFloat16
                                                   : attnserve::DType::kFloat32;
    return {dtype, t.shape, t.data.data(), t.data.size()};
  }
  void Loop() {
    for (;;) {
      std::pair<const Prepared*, std::function<void(int)>> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty() || pieces_.HasWork(); });
        if (queue_.empty()) {
          if (stop_) return;
          --idle_;
          lock.unlock();
          pieces_.Help();
          lock.lock();
          ++idle_;
          continue;
        }
        job = std::move(queue_.front());
        queue_.pop_front();
        queued_ = queue_.size();
        --idle_;
      }
      attnserve::AttendCall call = calls_.at(job.first);
      std::string out;
      attnserve::AttendOutputs outs;
      outs.output = &out;
      const attnserve::Status st = model_->ForwardBatch({&call}, {&outs}, pieces_)[0];
      ++idle_;
      job.second(st.ok() ? 0 : 13);
    }
  }
  std::shared_ptr<const attnserve::AttentionModel> model_;
  std::vector<std::shared_ptr<void>> blocks_;  // The pool's pinned bytes (CUDA).
  std::map<const Prepared*, attnserve::AttendCall> calls_;
  std::unique_ptr<attnserve::Batcher> batcher_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<const Prepared*, std::function<void(int)>>> queue_;
  bool stop_ = false;
  std::atomic<int> idle_;
  std::atomic<size_t> queued_{0};
  attnserve::PieceExchange pieces_;
  std::vector<std::thread> threads_;
};

// "fixed:128", "uniform:8:64", or "longtail" (70% 16-64, 25% 64-256, 5% 256-1024).
std::function<int64_t(std::mt19937&)> LengthDistribution(const std::string& spec) {
  if (spec.rfind("fixed:", 0) == 0) {
    const int64_t n = std::stoll(spec.substr(6));
    return [n](std::mt19937&) { return n; };
  }
  if (spec.rfind("uniform:", 0) == 0) {
    const size_t colon = spec.find(':', 8);
    const int64_t lo = std::stoll(spec.substr(8, colon - 8)),
                  hi = std::stoll(spec.substr(colon + 1));
    return
        [lo, hi](std::mt19937& rng) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  }
  if (spec == "longtail") {
    return [](std::mt19937& rng) {
      const double u = std::uniform_real_distribution<double>()(rng);
      auto uni = [&](int64_t lo, int64_t hi) {
        return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
      };
      return u < 0.70 ? uni(16, 64) : u < 0.95 ? uni(64, 256) : uni(256, 1024);
    };
  }
  throw std::invalid_argument("--lengths " + spec +
                              ": expected fixed:N, uniform:LO:HI or longtail");
}

// The bus's bound on this workload (CUDA): pinned host<->device bandwidth measured now (64 MiB
// copies), and the requests a second that copying each request's inputs in and its answer out
// at that rate, both ways at once, would allow.
nlohmann::json CopyBound(const std::string& device, const std::vector<Prepared>& pool) {
  attnserve::CopyBandwidth bw;
  const int index = device.size() > 5 ? std::atoi(device.c_str() + 5) : 0;
  if (!attnserve::MeasureCopyBandwidth(index, int64_t{64} << 20, &bw)) return nullptr;
  double in = 0, out = 0;
  for (const Prepared& p : pool) {
    in += static_cast<double>(p.request.query.data.size());
    if (p.request.key)
      in += static_cast<double>(p.request.key->data.size() + p.request.value->data.size());
    out += static_cast<double>(p.request.query.data.size());  // The answer: the query's shape.
  }
  in /= static_cast<double>(pool.size());
  out /= static_cast<double>(pool.size());
  nlohmann::json j;
  j["to_device_gbps"] = bw.to_device / 1e9;
  j["to_host_gbps"] = bw.to_host / 1e9;
  j["both_gbps"] = bw.both / 1e9;
  j["bytes_in"] = in;
  j["bytes_out"] = out;
  j["bound_requests_per_s"] = std::min(bw.both / in, bw.both / out);
  return j;
}

// The model's compute dtype as the wire's (--wire-dtype model): --dtype in process, else GetModel's
// (float32 when the server cannot say).
std::string ModelWire(const std::string& target, const std::string& dtype, const std::string& model,
                      const attnserve::ClientOptions& options) {
  if (target == "inprocess") return dtype;
  attnserve::Client client(options);
  attnserve::ModelInfo info;
  if (!client.GetModel(model, &info).ok()) return "float32";
  return info.compute_dtype == attnserve::DataType::kBFloat16  ? "bfloat16"
         : info.compute_dtype == attnserve::DataType::kFloat16 ? "float16"
                                                               : "float32";
}

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<long>(i), v.end());
  return v[i];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attnserve-bench: load generator for attnserve", "attnserve-bench"};
  std::string target = "127.0.0.1:50051", lengths = "uniform:8:64", label = "run", json_path;
  std::string model_name = "demo", models_dir, device = "cpu", dtype = "float32",
              wire_dtype = "model", profile_path;
  int callers = 32, workers = 2, pool_size = 64, embed = 512;
  double rate = 0, duration = 10, warmup = 2, cross = 0;
  uint32_t seed = 1;
  bool stream = false, batching = false, shared_memory = false;
  attnserve::ClientOptions client_options;
  client_options.target = target;
  attnserve::cli::AddClientFlags(
      app, &client_options,
      "host:port of attnserve, replicas (dns:///name:port, ipv4:a:p,b:p), "
      "or \"inprocess\" for the engine alone");
  app.add_option("--callers", callers, "Closed loop: concurrent callers")->capture_default_str();
  app.add_option("--rate", rate, "Open loop: requests per second (0 = closed loop)")
      ->capture_default_str();
  app.add_option("--lengths", lengths, "fixed:N, uniform:LO:HI or longtail")->capture_default_str();
  app.add_option("--cross", cross, "Fraction of cross-attention requests (key length drawn alike)")
      ->capture_default_str();
  app.add_flag("--stream", stream, "Closed loop over AttendStream: one stream per caller");
  app.add_option("--duration", duration, "Measured seconds")->capture_default_str();
  app.add_option("--warmup", warmup, "Unmeasured seconds first")->capture_default_str();
  app.add_option("--workers", workers, "inprocess: compute threads")->capture_default_str();
  app.add_flag("--batching", batching,
               "inprocess: batches formed by the server's batcher with its defaults for --device "
               "(default: each request computed alone, as it arrives)");
  app.add_option("--pool", pool_size, "Distinct prepared requests cycled through")
      ->capture_default_str();
  app.add_option("--embed-dim", embed, "Model embed_dim (demo: 512)")->capture_default_str();
  app.add_option("--model", model_name, "Model name")->capture_default_str();
  app.add_option("--models", models_dir,
                 "inprocess: the server's --models directory (default: demo)");
  app.add_option("--device", device, "inprocess: cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--dtype", dtype, "inprocess: compute dtype float32, float16 or bfloat16")
      ->capture_default_str();
  app.add_option("--wire-dtype", wire_dtype,
                 "Dtype of queries, keys and values on the wire (answers come back in it); model: "
                 "the model's compute dtype (GetModel, or --dtype in process)")
      ->check(CLI::IsMember({"model", "float32", "float16", "bfloat16"}))
      ->capture_default_str();
  app.add_flag("--shared-memory", shared_memory,
               "Closed loop against a server on this host (--allow-shared-memory): the requests' "
               "tensors in a registered shared-memory region, answers written into another");
  app.add_option("--label", label, "Name in the output")->capture_default_str();
  app.add_option("--device-profile", profile_path,
                 "inprocess on CUDA: LibTorch's profiler over half a second of the measured load "
                 "(from 1 s into it), written here as a Chrome trace");
  app.add_option("--json", json_path, "Append the result as one JSON line to this file");
  app.add_option("--seed", seed, "Seed of lengths and data")->capture_default_str();
  std::string tenant, tenant_header = "attnserve-tenant", samples_path;
  uint64_t priority = 0;
  app.add_option("--tenant", tenant,
                 "Send every call as this tenant, in the --tenant-header metadata (a server that "
                 "trusts that header, docs/tenants.md)");
  app.add_option("--tenant-header", tenant_header, "The metadata key --tenant goes in")
      ->capture_default_str();
  app.add_option("--priority", priority, "Every request's priority level (0: the default)")
      ->capture_default_str();
  app.add_option("--samples", samples_path,
                 "Write every measured request as a line: end time (s, system clock), latency "
                 "(ms), FLOPs, status code (bench/fairness.py reads them)");
  CLI11_PARSE(app, argc, argv);
  attnserve::cli::FinishClientFlags(&client_options);
  target = client_options.target;
  if ((stream || shared_memory) && (rate > 0 || target == "inprocess")) {
    std::fprintf(stderr,
                 "attnserve-bench: --stream and --shared-memory need a closed loop against a "
                 "server\n");
    return 2;
  }

  if (wire_dtype == "model") wire_dtype = ModelWire(target, dtype, model_name, client_options);
  std::mt19937 rng(seed);
  const auto draw_len = LengthDistribution(lengths);
  std::normal_distribution<float> normal;
  std::vector<Prepared> pool(static_cast<size_t>(pool_size));
  for (Prepared& p : pool) {
    const int64_t lq = draw_len(rng);
    auto tensor = [&](int64_t len) {
      std::vector<float> v(static_cast<size_t>(len * embed));
      for (float& x : v) x = normal(rng);
      return wire_dtype == "bfloat16"  ? attnserve::Tensor::BFloat16({1, len, embed}, v)
             : wire_dtype == "float16" ? attnserve::Tensor::Float16({1, len, embed}, v)
                                       : attnserve::Tensor::Float32({1, len, embed}, v);
    };
    p.request.model = model_name;
    p.request.priority = priority;
    p.request.query = tensor(lq);
    p.tokens = lq;
    int64_t lk = lq;
    if (std::uniform_real_distribution<double>()(rng) < cross) {
      lk = draw_len(rng);
      p.request.key = tensor(lk);
      p.request.value = tensor(lk);
      p.tokens += lk;
    }
    const double e = embed;
    p.flops = 2.0 * lq * e * e * 2 + 2.0 * lk * e * e * 2 + 4.0 * lq * lk * e;
  }
  std::unique_ptr<Backend> backend;
  if (target == "inprocess") {
    attnserve::EngineOptions options;
    options.device = device;
    options.compute_dtype = dtype == "float16"    ? attnserve::DType::kFloat16
                            : dtype == "bfloat16" ? attnserve::DType::kBFloat16
                                                  : attnserve::DType::kFloat32;
    try {
      backend =
          std::make_unique<EngineBackend>(workers, batching, models_dir, model_name, options, pool);
    } catch (const std::runtime_error& e) {
      std::fprintf(stderr, "attnserve-bench: %s\n", e.what());
      return 2;
    }
  } else {
    try {
      attnserve::CallOptions call;
      if (!tenant.empty()) call.metadata.emplace_back(tenant_header, tenant);
      backend = std::make_unique<ClientBackend>(client_options, stream ? callers : 0, model_name,
                                                shared_memory ? &pool : nullptr, callers, call);
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "attnserve-bench: %s\n", e.what());
      return 2;
    }
  }

  const std::string computes_on = backend->Device();
  // On a GPU, the bus: what copying this workload's bytes both ways would allow at most.
  nlohmann::json copy;
  if (target == "inprocess" && computes_on.rfind("cuda", 0) == 0)
    copy = CopyBound(computes_on, pool);

  std::mutex mu;
  std::vector<Sample> samples;
  std::atomic<bool> stop{false};
  std::atomic<int> outstanding{0};
  std::atomic<uint64_t> next{0};
  const auto start = Clock::now();
  const auto measure_from =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(warmup));
  const auto end = measure_from + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(duration));

  auto issue = [&](auto&& self, int caller, Clock::time_point sent) -> void {
    const Prepared& p = pool[next++ % pool.size()];
    ++outstanding;
    backend->Call(caller, p, [&, caller, sent, tokens = p.tokens, flops = p.flops, self](int code) {
      const auto now = Clock::now();
      if (sent >= measure_from && now <= end) {
        std::lock_guard<std::mutex> lock(mu);
        const double wall =
            std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
                .count();
        samples.push_back({std::chrono::duration<double, std::milli>(now - sent).count(), code,
                           tokens, flops, wall});
      }
      --outstanding;
      if (rate <= 0 && !stop && now < end) self(self, caller, Clock::now());  // Closed loop: next.
    });
  };

  if (rate <= 0) {
    for (int i = 0; i < callers; ++i) issue(issue, i, Clock::now());
  }
  std::thread pacer;
  if (rate > 0) {
    pacer = std::thread([&] {
      const auto step =
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / rate));
      auto due = Clock::now();
      while (!stop && due < end) {
        std::this_thread::sleep_until(due);
        issue(issue, 0, due);  // Latency counts from the scheduled time: no coordinated omission.
        due += step;
      }
    });
  }
  // Evidence of where a steady batch's device time goes: half a second of kernels and copies.
  std::thread profiler;
  if (!profile_path.empty()) {
    profiler = std::thread([&] {
      std::this_thread::sleep_until(std::min(measure_from + std::chrono::seconds(1), end));
      std::string error;
      bool ok = attnserve::StartDeviceProfile(&error);
      if (ok) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        ok = attnserve::StopDeviceProfile(profile_path, &error);
      }
      std::fprintf(stderr, "attnserve-bench: device profile: %s\n",
                   ok ? profile_path.c_str() : error.c_str());
    });
  }
  size_t last = 0;
  while (Clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    std::lock_guard<std::mutex> lock(mu);
    const double t = std::chrono::duration<double>(Clock::now() - start).count();
    std::fprintf(stderr, "\r[%s] %5.1fs  measured %zu (+%zu/s)  in flight %d   ", label.c_str(), t,
                 samples.size(), samples.size() - last, outstanding.load());
    last = samples.size();
  }
  stop = true;
  if (pacer.joinable()) pacer.join();
  if (profiler.joinable()) profiler.join();
  const auto drain_until = Clock::now() + std::chrono::seconds(60);
  while (outstanding > 0 && Clock::now() < drain_until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // Tear the client down (it waits for its callbacks), then give gRPC's threads a moment to leave
  // their completion code before the process exits.
  backend.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::fprintf(stderr, "\n");

  if (!samples_path.empty()) {
    std::ofstream out(samples_path);
    for (const Sample& s : samples) {
      out << std::fixed << s.end_s << ' ' << s.latency_ms << ' ' << s.flops << ' ' << s.code
          << '\n';
    }
  }
  std::vector<double> lat;
  std::map<std::string, int> errors;
  int64_t tokens = 0;
  double flops = 0;
  for (const Sample& s : samples) {
    if (s.code == 0) {
      lat.push_back(s.latency_ms);
      tokens += s.tokens;
      flops += s.flops;
    } else {
      ++errors[attnserve::StatusCodeName(s.code)];
    }
  }
  nlohmann::json j;
  j["label"] = label;
  j["target"] = target;
  j["cpu_class"] = attnserve::EngineCpuClass();  // this machine's, whatever the target's
  j["device"] = computes_on;                     // the model's, where it computes
  j["wire_dtype"] = wire_dtype;
  j["shared_memory"] = shared_memory;
  j["connections"] = client_options.connections;
  j["mode"] = rate > 0 ? "open" : stream ? "closed-stream" : "closed";
  j["callers"] = callers;
  j["rate"] = rate;
  j["lengths"] = lengths;
  j["cross"] = cross;
  j["duration_s"] = duration;
  j["ok"] = lat.size();
  j["errors"] = errors;
  // Open loop: requests due in the window but not answered in it (answered later, never, or not
  // even sent: a generator that falls behind). Past a system's capacity nothing is answered in
  // time, which would read as 0 req/s with no errors unless counted.
  const int64_t unanswered =
      rate > 0 ? std::llround(rate * duration) - static_cast<int64_t>(samples.size()) : 0;
  j["unanswered"] = std::max<int64_t>(0, unanswered);
  j["requests_per_s"] = static_cast<double>(lat.size()) / duration;
  j["tokens_per_s"] = static_cast<double>(tokens) / duration;
  j["tflops"] = flops / duration / 1e12;
  const double mx = lat.empty() ? 0 : *std::max_element(lat.begin(), lat.end());
  if (!copy.is_null()) {
    copy["of_bound"] =
        j["requests_per_s"].get<double>() / copy["bound_requests_per_s"].get<double>();
    j["copy"] = copy;
  }
  j["latency_ms"] = {{"p50", Percentile(lat, 0.50)},
                     {"p90", Percentile(lat, 0.90)},
                     {"p99", Percentile(lat, 0.99)},
                     {"max", mx}};
  std::printf(
      "%-28s %9.1f req/s %10.0f tok/s %7.3f TFLOP/s  p50 %7.2f  p90 %7.2f  p99 %7.2f  max %7.2f ms "
      " errors %s%s  [device %s; CPU class %s]\n",
      label.c_str(), j["requests_per_s"].get<double>(), j["tokens_per_s"].get<double>(),
      j["tflops"].get<double>(), j["latency_ms"]["p50"].get<double>(),
      j["latency_ms"]["p90"].get<double>(), j["latency_ms"]["p99"].get<double>(), mx,
      j["errors"].dump().c_str(),
      unanswered > 0 ? ("  unanswered in time " + std::to_string(unanswered)).c_str() : "",
      computes_on.c_str(), j["cpu_class"].get<std::string>().c_str());
  if (!copy.is_null()) {
    std::printf(
        "%-28s %9.1f req/s copy bound (pinned host<->device: %.1f GB/s in, %.1f out, %.1f "
        "each way at once; %.2f MB in, %.2f MB out a request): %.2f of it\n",
        label.c_str(), copy["bound_requests_per_s"].get<double>(),
        copy["to_device_gbps"].get<double>(), copy["to_host_gbps"].get<double>(),
        copy["both_gbps"].get<double>(), copy["bytes_in"].get<double>() / 1e6,
        copy["bytes_out"].get<double>() / 1e6, copy["of_bound"].get<double>());
  }
  if (!json_path.empty()) std::ofstream(json_path, std::ios::app) << j.dump() << "\n";
  return 0;
}
