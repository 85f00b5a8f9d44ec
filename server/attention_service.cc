#include "server/attention_service.h"

#include <cstdlib>

#include <iostream>

#include "server/grpc_status.h"
#include "server/stream_reactor.h"
#include "server/validator.h"
#include "server/wire.h"

namespace attnserve {
namespace {

double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

void SetTensorMeta(v1::Tensor* t, DType dtype, const std::vector<int64_t>& shape) {
  t->set_dtype(ToWire(dtype));
  t->mutable_shape()->Assign(shape.begin(), shape.end());
}

// NOT_FOUND for a model or version the set does not hold, naming what it does hold.
Status LookupFailure(const ModelSet& models, const std::string& name, int64_t version,
                     const char* name_field, const char* version_field) {
  auto it = models.models.find(name);
  if (it == models.models.end()) {
    return NotFound(std::string(name_field) + ": '" + name + "' is not loaded; available: " +
                    models.Names());
  }
  std::string versions;
  for (const auto& [v, m] : it->second) versions += (versions.empty() ? "" : ", ") + std::to_string(v);
  return NotFound(std::string(version_field) + ": " + std::to_string(version) + " of '" + name +
                  "' is not loaded; loaded versions: " + versions);
}

Status CheckModelVersion(int64_t version) {
  if (version >= 0) return Status::Ok();
  return InvalidArgument("model_version: " + std::to_string(version) +
                         "; allowed: 0 (the highest loaded) or a loaded version");
}

// The model a request's `model` and `model_version` name, in the repository's set of the moment.
StatusOr<std::shared_ptr<const AttentionModel>> FindModel(const ModelRepository& repository,
                                                          const std::string& name, int64_t version) {
  RETURN_IF_ERROR(CheckModelVersion(version));
  const std::shared_ptr<const ModelSet> models = repository.Snapshot();
  std::shared_ptr<const AttentionModel> model = models->Find(name, version);
  if (!model) return LookupFailure(*models, name, version, "model", "model_version");
  return model;
}

// An empty key/value cache for a memory or session of `model`.
StatusOr<std::shared_ptr<KvCache>> NewKvCacheOf(const AttentionModel& model) {
  std::shared_ptr<KvCache> cache = model.NewKvCache();
  if (!cache) {
    return Status(StatusCode::kFailedPrecondition,
                  "model '" + model.spec().name + "': its engine keeps no keys and values");
  }
  return cache;
}

}  // namespace

SteadyClock::time_point DeadlineOf(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return SteadyClock::time_point::max();
  return SteadyClock::now() + (deadline - std::chrono::system_clock::now());
}

AttentionServiceImpl::AttentionServiceImpl(const ModelRepository& models, Batcher& batcher,
                                           ServerMetrics& metrics, const AttendLimits& limits,
                                           const FlowLimits& flow, KvStore& kv)
    : models_(models), batcher_(batcher), metrics_(metrics), limits_(limits), flow_(flow), kv_(kv) {}

AttentionServiceImpl::~AttentionServiceImpl() = default;

void AttentionServiceImpl::Dispatch(const char* method, Exchange* x,
                                    SteadyClock::time_point deadline,
                                    std::function<bool()> cancelled,
                                    std::function<void(const Status&)> done) {
  metrics_.AddInFlight(method, 1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
    last_arrival_ = SteadyClock::now();
  }
  const v1::AttendRequest& request = x->request;
  auto item = std::make_unique<WorkItem>();
  item->accepted = x->received;
  item->deadline = deadline;
  item->cancelled = std::move(cancelled);
  Status st = CheckModelVersion(request.model_version());
  if (st.ok()) st = FromWire(request, &item->call);
  if (!st.ok()) {
    done(st);
    return;
  }
  std::shared_ptr<const AttentionModel> model;
  std::shared_ptr<KvStep> step;  // A session step: validated against its length, then reserved.
  if (!request.memory().empty() || !request.session().empty()) {
    // Keys and values kept on the server: the handle names the model.
    const bool session = !request.session().empty();
    if (session && !request.memory().empty()) {
      done(InvalidArgument("memory, session: a request names one or the other, not both"));
      return;
    }
    std::shared_ptr<KvEntry> entry;
    if (session) {
      auto begun = kv_.BeginStep(request.session(), request.has_session_length()
                                                        ? std::optional<int64_t>(request.session_length())
                                                        : std::nullopt);
      if (!begun.ok()) {
        done(begun.status());
        return;
      }
      step = std::move(*begun);
      entry = step->entry();
      item->call.kv_use = AttendCall::Kv::kSession;
      item->call.kv_length = step->length();
      // The step counts once its answer is computed in time for the client; refused or failed at
      // any point from here, or computed after the deadline or a cancel (the answer would be
      // dropped), the session is as it was. It ends before the answer leaves, so the client's next
      // step finds it idle.
      done = [step, deadline, cancelled = item->cancelled, done = std::move(done)](const Status& result) {
        Status seen = result;
        if (seen.ok() && SteadyClock::now() >= deadline) {
          seen = Status(StatusCode::kDeadlineExceeded, "deadline passed during compute; the step was not applied");
        } else if (seen.ok() && cancelled && cancelled()) {
          seen = Status(StatusCode::kCancelled, "cancelled by the client during compute; the step was not applied");
        }
        step->End(seen.ok());
        done(seen);
      };
    } else {
      auto found = kv_.Lookup(request.memory(), KvKind::kMemory);
      if (!found.ok()) {
        done(found.status());
        return;
      }
      entry = *found;
      item->call.kv_use = AttendCall::Kv::kMemory;
      item->call.kv_length = entry->length;
    }
    model = entry->model;
    const ModelSpec& spec = model->spec();
    if ((!request.model().empty() && request.model() != spec.name) ||
        (request.model_version() != 0 && request.model_version() != spec.version)) {
      done(InvalidArgument("model: '" + request.model() + "' version " + std::to_string(request.model_version()) +
                           ", but " + (session ? "session" : "memory") + " '" + entry->handle +
                           "' belongs to model '" + spec.name + "' version " + std::to_string(spec.version) +
                           " (leave model empty and model_version 0 to use the handle's)"));
      return;
    }
    item->call.kv = entry->cache;
    item->call.kv_batch = entry->batch;
    item->kv_entry = entry;
  } else {
    auto found = FindModel(models_, request.model(), request.model_version());
    if (!found.ok()) {
      done(found.status());
      return;
    }
    model = *std::move(found);
  }
  x->model = model->spec().name;
  item->model = model;
  st = Validate(item->model->spec(), limits_, &item->call);
  if (st.ok() && step) {
    st = step->Reserve(item->call.query_len);
    item->call.kv_capacity = step->capacity();
  }
  if (!st.ok()) {
    done(st);
    return;
  }
  // Request and answer bytes count against the in-flight budget until the outcome is recorded.
  const int64_t bytes = static_cast<int64_t>(request.ByteSizeLong()) + item->call.output_bytes +
                        item->call.weights_bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (held_bytes_ > 0 && held_bytes_ + bytes > flow_.max_inflight_bytes) {
      const std::string held = std::to_string(held_bytes_);
      st = Status(StatusCode::kResourceExhausted,
                  "server memory for requests in flight is full: " + held + " bytes held, this "
                  "request needs " + std::to_string(bytes) + " of at most " +
                  std::to_string(flow_.max_inflight_bytes) +
                  " (server flag --max-inflight-bytes); retry later");
    } else {
      held_bytes_ += bytes;
      x->held_bytes = bytes;
    }
  }
  if (!st.ok()) {
    metrics_.RecordRejection(x->model, "memory");
    done(st);
    return;
  }
  // The engine writes straight into these; EncodeResponse hands them to gRPC without a copy.
  auto output = std::make_shared<std::unique_ptr<std::string>>(std::make_unique<std::string>());
  auto weights = std::make_shared<std::unique_ptr<std::string>>();
  item->outputs.output = output->get();
  if (item->call.weights != WeightsMode::kNone) {
    *weights = std::make_unique<std::string>();
    item->outputs.weights = weights->get();
  }
  item->done = [x, output, weights, done = std::move(done)](const Status& st, const WorkItem& w) {
    if (st.ok()) {
      const ModelSpec& spec = w.model->spec();
      v1::AttendResponse meta;
      meta.set_request_id(x->request.request_id());
      meta.set_model(spec.name);
      meta.set_weights_hash(spec.weights_hash);
      meta.set_model_version(spec.version);
      SetTensorMeta(meta.mutable_output(), w.call.query.dtype, w.outputs.output_shape);
      if (w.outputs.weights) {
        SetTensorMeta(meta.mutable_attn_weights(), w.call.query.dtype, w.outputs.weights_shape);
      }
      auto* timing = meta.mutable_timing();
      timing->set_queue_seconds(w.queue_seconds);
      timing->set_compute_seconds(w.compute_seconds);
      timing->set_batch_size(static_cast<uint32_t>(w.batch_size));
      timing->set_previous_attempts(x->previous_attempts);
      if (w.call.kv_use == AttendCall::Kv::kSession) meta.set_session_length(w.call.kv_length + w.call.query_len);
      x->encoded = EncodeResponse(meta, std::move(*output), std::move(*weights));
    }
    done(st);
  };
  batcher_.Submit(std::move(item));
}

void AttentionServiceImpl::Record(const char* method, Exchange* x, const Status& seen) {
  if (x->recorded) return;
  x->recorded = true;
  if (seen.code() == StatusCode::kInternal) std::cerr << "attnserve: " << seen.ToString() << "\n";
  metrics_.RecordRequest(x->model, method, GrpcCodeName(seen), SecondsSince(x->received));
  metrics_.AddInFlight(method, -1);
  std::lock_guard<std::mutex> lock(mu_);
  held_bytes_ -= x->held_bytes;
  x->held_bytes = 0;
  --in_flight_;
  if (in_flight_ == 0) idle_cv_.notify_all();
}

void AttentionServiceImpl::RecordUndecoded(const char* method, const Status& seen) {
  metrics_.RecordRequest("", method, GrpcCodeName(seen), 0);
  std::lock_guard<std::mutex> lock(mu_);
  last_arrival_ = SteadyClock::now();
}

namespace {

/// A unary call whose request message never arrived: the client cancelled before sending it, or
/// half-closed without one. (An empty message is a valid, empty AttendRequest.) Which of the two it
/// was is only certain once the call is done, so the outcome is recorded in OnDone.
class NoMessageReactor final : public grpc::ServerUnaryReactor {
 public:
  NoMessageReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    Finish(ToGrpcStatus(kRefusal));
  }
  void OnDone() override {
    service_->RecordUndecoded(
        "Attend", ctx_->IsCancelled()
                      ? Status(StatusCode::kCancelled, "cancelled before its request arrived")
                      : kRefusal);
    delete this;
  }

 private:
  inline static const Status kRefusal =
      InvalidArgument("request: no request message arrived (the client half-closed without one); "
                      "Attend takes exactly one AttendRequest");
  AttentionServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* req,
                                                       grpc::ByteBuffer* resp) {
  if (!req->Valid()) return new NoMessageReactor(this, ctx);
  auto x = std::make_unique<Exchange>();
  x->received = SteadyClock::now();
  auto* reactor = ctx->DefaultReactor();
  const Status parsed = ParseRequest(*req, &x->request);
  if (!parsed.ok()) {
    RecordUndecoded("Attend", parsed);
    reactor->Finish(ToGrpcStatus(parsed));
    return reactor;
  }
  // A client's retry policy marks each new attempt (gRFC A6); the answer reports it back.
  const auto& client_metadata = ctx->client_metadata();
  if (auto it = client_metadata.find("grpc-previous-rpc-attempts"); it != client_metadata.end()) {
    x->previous_attempts = static_cast<uint32_t>(std::strtoul(std::string(it->second.data(), it->second.size()).c_str(), nullptr, 10));
  }
  const auto deadline = DeadlineOf(ctx);
  Exchange* raw = x.release();
  Dispatch("Attend", raw, deadline, [ctx] { return ctx->IsCancelled(); },
           [this, raw, ctx, reactor, resp, deadline](const Status& st) {
             // Record what the client sees: an answer computed after its deadline or after it
             // cancelled never reaches it.
             Status seen = st;
             if (st.ok() && SteadyClock::now() >= deadline) {
               seen = Status(StatusCode::kDeadlineExceeded,
                             "deadline passed during compute; the answer was dropped");
             } else if (st.ok() && ctx->IsCancelled()) {
               seen = Status(StatusCode::kCancelled, "cancelled by the client during compute");
             } else if (st.ok()) {
               resp->Swap(&raw->encoded);
             }
             Record("Attend", raw, seen);
             delete raw;
             reactor->Finish(ToGrpcStatus(seen));
           });
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(this, ctx);
}

void AttentionServiceImpl::AddStream(StreamReactor* s) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.insert(s);
  last_arrival_ = SteadyClock::now();
}

void AttentionServiceImpl::RemoveStream(StreamReactor* s) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(s);
  if (streams_.empty()) idle_cv_.notify_all();
}

void AttentionServiceImpl::BeginDrain() {
  draining_ = true;
  std::vector<StreamReactor*> finish;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (StreamReactor* s : streams_) {
      if (s->Drain()) finish.push_back(s);
    }
  }
  // Outside mu_: a finished stream's OnDone removes it from streams_. It cannot be deleted before
  // FinishNow, which is the only Finish it will get.
  for (StreamReactor* s : finish) s->FinishNow();
}

bool AttentionServiceImpl::WaitIdle(SteadyClock::time_point deadline, SteadyClock::duration quiet) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const bool idle = in_flight_ == 0 && streams_.empty();
    const auto quiet_since = last_arrival_ + quiet;
    const auto now = SteadyClock::now();
    if (idle && now >= quiet_since) return true;
    if (now >= deadline) return false;
    // In-flight work notifies when it ends; a quiet period just needs time to pass.
    idle_cv_.wait_until(lock, std::min(deadline, idle ? quiet_since : now + quiet));
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* ctx,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* resp) {
  const std::shared_ptr<const ModelSet> models = models_.Snapshot();
  for (const auto& [name, versions] : models->models) {
    for (const auto& [version, model] : versions) ToWire(model->spec(), resp->add_models());
  }
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* ctx,
                                                         const v1::GetModelRequest* req,
                                                         v1::ModelInfo* resp) {
  auto* reactor = ctx->DefaultReactor();
  const std::shared_ptr<const ModelSet> models = models_.Snapshot();
  const auto model = req->version() < 0 ? nullptr : models->Find(req->name(), req->version());
  if (req->version() < 0) {
    reactor->Finish(ToGrpcStatus(InvalidArgument("version: " + std::to_string(req->version()) +
                                                 "; allowed: 0 (the highest loaded) or a loaded version")));
  } else if (!model) {
    reactor->Finish(ToGrpcStatus(LookupFailure(*models, req->name(), req->version(), "name", "version")));
  } else {
    ToWire(model->spec(), resp);
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

namespace {

void FillHandle(const KvEntry& e, int64_t length, int64_t bytes, double ttl, v1::KvHandle* h) {
  const ModelSpec& spec = e.model->spec();
  h->set_handle(e.handle);
  h->set_model(spec.name);
  h->set_model_version(spec.version);
  h->set_weights_hash(spec.weights_hash);
  h->set_batch(e.batch);
  h->set_length(length);
  h->set_bytes(bytes);
  h->set_ttl_seconds(ttl);
}

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::CreateMemory(grpc::CallbackServerContext* ctx,
                                                             const v1::CreateMemoryRequest* req,
                                                             v1::KvHandle* resp) {
  auto* reactor = ctx->DefaultReactor();
  const auto received = SteadyClock::now();
  const auto finish = [this, reactor, received](const std::string& model, const Status& st) {
    metrics_.RecordRequest(model, "CreateMemory", GrpcCodeName(st), SecondsSince(received));
    reactor->Finish(ToGrpcStatus(st));
  };
  auto found = FindModel(models_, req->model(), req->model_version());
  if (!found.ok()) {
    finish("", found.status());
    return reactor;
  }
  const std::shared_ptr<const AttentionModel> model = *std::move(found);
  const std::string name = model->spec().name;
  auto item = std::make_unique<WorkItem>();
  item->accepted = received;
  item->deadline = DeadlineOf(ctx);
  item->cancelled = [ctx] { return ctx->IsCancelled(); };
  item->model = model;
  Status st = FromWire(*req, &item->call);
  if (st.ok()) st = ValidateCreateMemory(model->spec(), limits_, &item->call);
  StatusOr<std::shared_ptr<KvCache>> cache = st;
  if (st.ok()) cache = NewKvCacheOf(*model);
  StatusOr<std::shared_ptr<KvEntry>> entry = cache.status();
  if (cache.ok()) entry = kv_.Create(KvKind::kMemory, model, *cache, item->call.batch, item->call.key_len);
  if (!entry.ok()) {
    finish(name, entry.status());
    return reactor;
  }
  item->call.kv = *cache;
  item->kv_entry = *entry;
  const int64_t length = item->call.key_len;
  item->done = [this, finish, name, entry = *entry, length, resp](Status st, const WorkItem&) {
    if (st.ok()) st = kv_.MarkReady(entry, length);
    if (st.ok()) {
      FillHandle(*entry, length, entry->bytes, kv_.options().ttl_seconds, resp);
    } else {
      kv_.Discard(entry);
    }
    finish(name, st);
  };
  batcher_.Submit(std::move(item));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(grpc::CallbackServerContext* ctx,
                                                            const v1::OpenSessionRequest* req,
                                                            v1::KvHandle* resp) {
  auto* reactor = ctx->DefaultReactor();
  const auto received = SteadyClock::now();
  std::shared_ptr<const AttentionModel> model;
  const auto open = [&]() -> Status {
    ASSIGN_OR_RETURN(model, FindModel(models_, req->model(), req->model_version()));
    if (req->batch() < 1 || req->batch() > limits_.max_tokens) {
      return InvalidArgument("batch: " + std::to_string(req->batch()) + "; allowed: 1 to " +
                             std::to_string(limits_.max_tokens) + " (server flag --max-request-tokens)");
    }
    const ModelSpec& m = model->spec();
    if (m.kdim != m.embed_dim || m.vdim != m.embed_dim) {
      return InvalidArgument("model: '" + m.name + "' has kdim=" + std::to_string(m.kdim) + ", vdim=" +
                             std::to_string(m.vdim) + " != embed_dim=" + std::to_string(m.embed_dim) +
                             "; a decoding session is self-attention, which needs kdim = vdim = embed_dim");
    }
    ASSIGN_OR_RETURN(std::shared_ptr<KvCache> cache, NewKvCacheOf(*model));
    ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> entry, kv_.Create(KvKind::kSession, model, cache, req->batch(), 0));
    FillHandle(*entry, 0, entry->bytes, kv_.options().ttl_seconds, resp);
    return Status::Ok();
  };
  const Status st = open();
  metrics_.RecordRequest(model ? model->spec().name : "", "OpenSession", GrpcCodeName(st), SecondsSince(received));
  reactor->Finish(ToGrpcStatus(st));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Release(grpc::CallbackServerContext* ctx, const char* method,
                                                        KvKind kind, const std::string& handle,
                                                        v1::ReleaseResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  const auto received = SteadyClock::now();
  StatusOr<int64_t> freed = kv_.Release(handle, kind);
  if (freed.ok()) resp->set_bytes_freed(*freed);
  metrics_.RecordRequest("", method, GrpcCodeName(freed.status()), SecondsSince(received));
  reactor->Finish(ToGrpcStatus(freed.status()));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::DeleteMemory(grpc::CallbackServerContext* ctx,
                                                             const v1::ReleaseRequest* req,
                                                             v1::ReleaseResponse* resp) {
  return Release(ctx, "DeleteMemory", KvKind::kMemory, req->handle(), resp);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(grpc::CallbackServerContext* ctx,
                                                             const v1::ReleaseRequest* req,
                                                             v1::ReleaseResponse* resp) {
  return Release(ctx, "CloseSession", KvKind::kSession, req->handle(), resp);
}

}  // namespace attnserve
