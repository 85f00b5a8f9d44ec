#include "server/pipeline/request_pipeline.h"

#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>

#include "server/core/deadline.h"
#include "server/core/validator.h"
#include "server/core/wire.h"

namespace attnserve {
namespace {

double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

double Millis(SteadyClock::time_point from, SteadyClock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// The RPC service a method label belongs to (OpenTelemetry's rpc.service).
const char* ServiceOf(const char* method) {
  const std::string m = method;
  return m == "ModelInfer" || m == "ModelStreamInfer" ? "inference.GRPCInferenceService"
                                                      : "attnserve.v1.AttentionService";
}

// The wall-clock time now as RFC 3339 UTC with milliseconds.
std::string NowUtc() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char text[40];
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()) % 1000;
  const size_t n = std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(text + n, sizeof text - n, ".%03dZ", static_cast<int>(ms.count()));
  return text;
}

// A call's own span, from `received` to `end`: OpenTelemetry's RPC name ({service}/{method}) and
// attributes, and the call's status.
SpanData CallSpan(const Tracer& tracer, const CallTrace& trace, const char* method,
                  SteadyClock::time_point received, SteadyClock::time_point end,
                  const Status& seen) {
  const std::string m = method;
  SpanData span;
  if (m.rfind("http/", 0) == 0) {
    // The Open Inference Protocol over HTTP: OpenTelemetry's HTTP server span, named by its route.
    const std::string route = "/v2/models/{model_name}/infer";
    span = tracer.ServerSpan(trace, "POST " + route, received, end);
    span.Set("http.request.method", std::string("POST"));
    span.Set("http.route", route);
  } else {
    span = tracer.ServerSpan(trace, std::string(ServiceOf(method)) + "/" + method, received, end);
    span.Set("rpc.system", std::string("grpc"));
    span.Set("rpc.service", std::string(ServiceOf(method)));
    span.Set("rpc.method", m);
  }
  span.Set("attnserve.status", std::string(StatusCodeName(seen.code())));  // the metrics' label
  if (!seen.ok()) {
    span.error = true;
    span.error_message = seen.message();
  }
  return span;
}

void SetTensorMeta(v1::Tensor* t, DType dtype, const std::vector<int64_t>& shape) {
  t->set_dtype(ToWire(dtype));
  t->mutable_shape()->Assign(shape.begin(), shape.end());
}

// The answer's fields besides the tensors' bytes, for a computed item.
v1::AttendResponse AnswerMeta(const v1::AttendRequest& request, const WorkItem& w,
                              uint32_t previous_attempts) {
  const ModelSpec& spec = w.model->spec();
  v1::AttendResponse meta;
  meta.set_request_id(request.request_id());
  meta.set_model(spec.name);
  meta.set_weights_hash(spec.weights_hash);
  meta.set_model_version(spec.version);
  SetTensorMeta(meta.mutable_output(), w.call.query.dtype, w.call.output_shape);
  if (w.outputs.weights)
    SetTensorMeta(meta.mutable_attn_weights(), w.call.query.dtype, w.call.weights_shape);
  auto* timing = meta.mutable_timing();
  timing->set_queue_seconds(w.queue_seconds);
  timing->set_compute_seconds(w.compute_seconds);
  timing->set_batch_size(static_cast<uint32_t>(w.batch_size));
  timing->set_previous_attempts(previous_attempts);
  if (w.call.kv_use == AttendCall::Kv::kSession)
    meta.set_session_length(w.call.kv_length + w.call.query_len);
  return meta;
}

// What the client can be told of a computed result: an answer finished after its deadline or after
// it cancelled never reaches it (and a session's step is then not applied).
Status Deliverable(const CallContext& call, const Status& computed, bool step) {
  if (!computed.ok()) return computed;
  const char* consequence = step ? "the step was not applied" : "the answer was dropped";
  const bool cancelled = call.IsCancelled();
  if (DeadlineEnded(call.deadline, SteadyClock::now(), cancelled)) {
    return Status(StatusCode::kDeadlineExceeded,
                  std::string("deadline passed during compute; ") + consequence);
  }
  if (cancelled) {
    return Status(StatusCode::kCancelled,
                  std::string("cancelled by the client during compute; ") + consequence);
  }
  return computed;
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

// The KvHandle answer for an entry: `length` as this call left it, or (unset) the store's now.
void FillHandle(const KvEntry& e, std::optional<int64_t> length, const KvStore& kv,
                const std::string& replica, v1::KvHandle* h) {
  const ModelSpec& spec = e.model->spec();
  const KvEntryInfo now = kv.Info(e);  // bytes and length are the store's, under its lock
  h->set_handle(now.handle);
  h->set_model(spec.name);
  h->set_model_version(spec.version);
  h->set_weights_hash(spec.weights_hash);
  h->set_batch(now.batch);
  h->set_length(length.value_or(now.length));
  h->set_bytes(now.bytes);
  h->set_ttl_seconds(kv.options().ttl_seconds);
  h->set_replica(replica);
}

// The memory or session a request names, begun (a session step) or looked up (a memory), and
// checked against the model the request names, if any.
Status ResolveKept(KvStore& kv, const v1::AttendRequest& request, const std::string& tenant,
                   WorkItem* item, std::shared_ptr<KvStep>* step) {
  const bool session = !request.session().empty();
  if (session && !request.memory().empty()) {
    return InvalidArgument("memory, session: a request names one or the other, not both");
  }
  std::shared_ptr<KvEntry> entry;
  if (session) {
    const auto length = request.has_session_length()
                            ? std::optional<int64_t>(request.session_length())
                            : std::nullopt;
    ASSIGN_OR_RETURN(*step, kv.BeginStep(request.session(), length, tenant));
    entry = (*step)->entry();
    item->call.kv_use = AttendCall::Kv::kSession;
    item->call.kv_length = (*step)->length();
  } else {
    ASSIGN_OR_RETURN(entry, kv.Lookup(request.memory(), KvKind::kMemory, tenant));
    item->call.kv_use = AttendCall::Kv::kMemory;
    item->call.kv_length = entry->length;
  }
  const ModelSpec& spec = entry->model->spec();
  if ((!request.model().empty() && request.model() != spec.name) ||
      (request.model_version() != 0 && request.model_version() != spec.version)) {
    return InvalidArgument(
        "model: '" + request.model() + "' version " + std::to_string(request.model_version()) +
        ", but " + (session ? "session" : "memory") + " '" + entry->handle +
        "' belongs to model '" + spec.name + "' version " + std::to_string(spec.version) +
        " (leave model empty and model_version 0 to use the handle's)");
  }
  item->model = entry->model;
  item->call.kv = entry->cache;
  item->call.kv_batch = entry->batch;
  item->kv_entry = entry;
  return Status::Ok();
}

}  // namespace

RequestPipeline::RequestPipeline(const ModelRepository& models, Batcher& batcher,
                                 ServerMetrics& metrics, const AttendLimits& limits,
                                 const FlowLimits& flow, KvStore& kv)
    : models_(models),
      batcher_(batcher),
      metrics_(metrics),
      limits_(limits),
      flow_(flow),
      kv_(kv) {}

void RequestPipeline::Attend(const char* method, std::unique_ptr<Exchange> owned, CallContext call,
                             std::function<void(Answered)> done) {
  // Owned by the request's path from here until `finish` hands it to the front end's handle.
  Exchange* x = owned.release();
  metrics_.AddInFlight(method, 1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
    last_arrival_ = SteadyClock::now();
  }
  // The tenants' terms of the moment the request arrived, read once.
  const std::shared_ptr<const Tenants> tenants = this->tenants();
  x->tenant = call.tenant;
  x->tenant_label = tenants->Label(call.tenant);
  x->caller = CallerOf(call);
  auto item = std::make_unique<WorkItem>();
  item->accepted = x->received;
  item->deadline = call.deadline;
  item->cancelled = call.cancelled;
  if (tracer_) {
    // A request's own trace context (a stream's requests may each carry one) wins over the call's.
    x->trace =
        tracer_->Begin(x->request.traceparent().empty()
                           ? call.trace
                           : ReadIncoming(x->request.traceparent(), x->request.tracestate()));
    item->trace = &x->trace;
  }
  std::shared_ptr<KvStep> step;
  // A batched step (AttendRequest.steps): its entries' sessions and memories.
  std::shared_ptr<StepsHeld> steps =
      x->request.steps_size() > 0 ? std::make_shared<StepsHeld>() : nullptr;
  const uint32_t attempts = call.previous_attempts;
  x->times.attempts = attempts;
  Status st = steps ? ResolveSteps(x, item.get(), steps.get()) : Resolve(x, item.get(), &step);
  // A batched step none of whose entries passed is answered at once: there is nothing to compute.
  const bool compute = !steps || !item->entries.empty();
  if (st.ok() && compute) st = Schedule(*x, tenants->Of(call.tenant), item.get());
  x->level = item->level;
  if (st.ok() && compute) st = Admit(x, *item);
  x->times.admitted = SteadyClock::now();
  x->times.tokens = item->tokens();
  // A session step counts once its answer is computed in time for the client; refused or failed at
  // any point, or computed too late, the session is as it was. It ends before the answer leaves,
  // so the client's next step finds it idle.
  auto finish = [this, method, x, step = std::move(step), steps, call = std::move(call),
                 done = std::move(done)](const Status& result) mutable {
    Status seen = Deliverable(call, result, step != nullptr || steps != nullptr);
    if (step) step->End(seen.ok());
    step.reset();  // Idle and not held: the client's next call may evict it.
    if (steps) {
      steps->End(seen.ok(), x->answer.step_status);
      if (seen.ok()) metrics_.RecordSteps(x->model, x->answer.step_status);
    }
    x->times.answered = SteadyClock::now();
    done(Answered(this, method, std::unique_ptr<Exchange>(x), std::move(seen), call.deadline));
  };
  if (!st.ok()) {
    finish(st);
    return;
  }
  if (steps) {
    SubmitSteps(x, std::move(item), std::move(steps), attempts, std::move(finish));
    return;
  }
  // The engine writes straight into these; the front end encodes them without a copy.
  x->answer.output = std::make_unique<std::string>();
  item->outputs.output = x->answer.output.get();
  if (item->call.weights != WeightsMode::kNone) {
    x->answer.weights = std::make_unique<std::string>();
    item->outputs.weights = x->answer.weights.get();
  }
  item->done = [x, attempts, finish = std::move(finish)](const Status& st,
                                                         const WorkItem& w) mutable {
    if (st.ok()) x->answer.meta = AnswerMeta(x->request, w, attempts);
    x->answer.output_block = w.outputs.output_block;
    Computed(x, w);
    finish(st);
  };
  batcher_.Submit(std::move(item));
}

void RequestPipeline::Computed(Exchange* x, const WorkItem& w) {
  x->staged = StagedInputs();  // Computed: the staged inputs go back to the staging's budget.
  x->times.started = w.started;
  x->times.finished = w.finished;
  x->times.batch_trace = w.batch_trace;
  x->times.batch_span = w.batch_span;
  x->times.batch_size = w.batch_size;
}

Status RequestPipeline::Resolve(Exchange* x, WorkItem* item, std::shared_ptr<KvStep>* step) {
  const v1::AttendRequest& request = x->request;
  if (request.model_version() < 0) {
    return InvalidArgument("model_version: " + std::to_string(request.model_version()) +
                           "; allowed: 0 (the highest loaded) or a loaded version");
  }
  RETURN_IF_ERROR(FromWire(request, &item->call));
  UseStaged(x->staged, &item->call);
  if (!request.memory().empty() || !request.session().empty()) {
    // Keys and values kept on the server: the handle names the model.
    RETURN_IF_ERROR(ResolveKept(kv_, request, x->tenant, item, step));
  } else {
    ASSIGN_OR_RETURN(item->model,
                     models_.Snapshot()->Lookup(request.model(), request.model_version()));
  }
  x->model = item->model->spec().name;
  RETURN_IF_ERROR(Validate(item->model->spec(), limits_, &item->call));
  RETURN_IF_ERROR(x->output_limits.Check(item->call));
  if (*step) {
    RETURN_IF_ERROR((*step)->Reserve(item->call.query_len));
    item->call.kv_capacity = (*step)->capacity();
  }
  return Status::Ok();
}

Status RequestPipeline::Schedule(const Exchange& x, const TenantPolicy& terms,
                                 WorkItem* item) const {
  item->tenant = x.caller;
  item->tenant_label = x.tenant_label;
  item->weight = terms.weight;
  item->tenant_queue_cap = terms.max_queued_requests > 0;
  item->tenant_max_queued = item->tenant_queue_cap
                                ? terms.max_queued_requests
                                : static_cast<int64_t>(batcher_.options().max_queued_per_caller);
  item->flops = ForwardFlops(item->model->spec(), item->call);
  if (!item->entries.empty()) {  // A batched step: its entries' work.
    item->flops = 0;
    for (const WorkItem::Entry& e : item->entries)
      item->flops += ForwardFlops(item->model->spec(), e.call);
  }
  const PriorityOptions& priorities = batcher_.PrioritiesOf(*item->model);
  // The tenant's cap applies here, before the level's queue policy is read, so the queue, its
  // timeout, the span and the access log all see the level the request is actually queued at.
  ASSIGN_OR_RETURN(item->level,
                   priorities.LevelOf(x.request.priority(), terms.best_priority_level));
  const int64_t timeout_us = priorities.TimeoutUs(item->level, x.request.queue_timeout_us());
  if (timeout_us > 0) {
    // Far timeouts (up to 2^63 µs) saturate at the end of time rather than wrap: compared in
    // microseconds, which hold them.
    const int64_t left_us = std::chrono::duration_cast<std::chrono::microseconds>(
                                SteadyClock::time_point::max() - item->accepted)
                                .count();
    item->queue_timeout = timeout_us < left_us
                              ? item->accepted + std::chrono::microseconds(timeout_us)
                              : SteadyClock::time_point::max();
    item->timeout_action = priorities.PolicyOf(item->level).timeout_action;
  }
  return Status::Ok();
}

void RequestPipeline::SetTenants(std::shared_ptr<const Tenants> tenants) {
  kv_.SetTenants(tenants);
  std::lock_guard<std::mutex> lock(mu_);
  tenants_ = std::move(tenants);
}

std::shared_ptr<const Tenants> RequestPipeline::tenants() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tenants_;
}

Status RequestPipeline::Admit(Exchange* x, const WorkItem& item) {
  // Request and answer bytes count against the in-flight budget until the outcome is recorded.
  // A batched step's entries each hold their call, statuses and answer fields on the server too.
  const int64_t bytes =
      WidenedBytes(static_cast<int64_t>(x->request.ByteSizeLong()) + x->staged.bytes() +
                       item.call.output_bytes + item.call.weights_bytes,
                   item.call.query.dtype, item.model->spec().compute_dtype) +
      int64_t{x->request.steps_size()} * kStepBookkeepingBytes;
  Status reserved = Reserve(x->model, bytes, x->caller);
  if (!reserved.ok()) {
    metrics_.RecordTenantRejection(x->tenant_label, "memory");
    return reserved;
  }
  x->held_bytes = bytes;
  return Status::Ok();
}

int64_t RequestPipeline::WidenedBytes(int64_t wire_bytes, DType wire, DType compute) {
  // A request on a narrower wire than its model computes in is held widened (a float16 request
  // to a float32 model: its decoded copy, projections and answer are float32).
  const size_t w = DTypeSize(wire), c = DTypeSize(compute);
  return w > 0 && c > w ? wire_bytes * static_cast<int64_t>(c / w) : wire_bytes;
}

Status RequestPipeline::Reserve(const std::string& model, int64_t bytes,
                                const std::string& caller) {
  std::string refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t& mine = held_by_caller_[caller];
    const int64_t per_caller = flow_.InflightPerCaller();
    // One request runs alone whatever its size: the per-request limits bound it.
    const bool whole_fits = held_bytes_ == 0 || held_bytes_ + bytes <= flow_.max_inflight_bytes;
    const bool mine_fits = mine == 0 || mine + bytes <= per_caller;
    if (whole_fits && mine_fits) {
      held_bytes_ += bytes;
      mine += bytes;
      metrics_.SetInflightBytes(held_bytes_);
      return Status::Ok();
    }
    refusal = whole_fits
                  ? "caller '" + caller + "' holds " + std::to_string(mine) +
                        " bytes of requests in flight, this request needs " +
                        std::to_string(bytes) + " of at most " + std::to_string(per_caller) +
                        " (server flag --max-inflight-bytes-per-caller); retry later"
                  : "server memory for requests in flight is full: " + std::to_string(held_bytes_) +
                        " bytes held, this request needs " + std::to_string(bytes) +
                        " of at most " + std::to_string(flow_.max_inflight_bytes) +
                        " (server flag --max-inflight-bytes); retry later";
    if (mine == 0) held_by_caller_.erase(caller);
  }
  metrics_.RecordRejection(model, "memory");
  return Status(StatusCode::kResourceExhausted, refusal);
}

void RequestPipeline::Unreserve(int64_t bytes, const std::string& caller) {
  std::lock_guard<std::mutex> lock(mu_);
  UnreserveLocked(bytes, caller);
}

void RequestPipeline::UnreserveLocked(int64_t bytes, const std::string& caller) {
  if (bytes == 0) return;
  held_bytes_ -= bytes;
  metrics_.SetInflightBytes(held_bytes_);
  const auto it = held_by_caller_.find(caller);
  if (it != held_by_caller_.end() && (it->second -= bytes) <= 0) held_by_caller_.erase(it);
}

std::string RequestPipeline::CallerOf(const CallContext& call) const {
  if (call.tenant != kDefaultTenant || !caller_by_peer_ || call.peer.empty()) return call.tenant;
  return std::string(kDefaultTenant) + "@" + call.peer;
}

void RequestPipeline::Record(const char* method, Exchange* x, const Status& seen) {
  if (seen.code() == StatusCode::kInternal) std::cerr << "attnserve: " << seen.ToString() << "\n";
  metrics_.RecordRequest(x->model, method, StatusCodeName(seen.code()), SecondsSince(x->received));
  metrics_.RecordTenantRequest(x->tenant_label, StatusCodeName(seen.code()));
  const SteadyClock::time_point none{};
  const Exchange::Times& tm = x->times;
  metrics_.RecordRequestStages(
      tm.admitted == none ? -1 : std::chrono::duration<double>(tm.admitted - x->received).count(),
      tm.answered == none ? -1 : SecondsSince(tm.answered));
  metrics_.AddInFlight(method, -1);
  Observed(method, *x, seen);
  std::lock_guard<std::mutex> lock(mu_);
  UnreserveLocked(x->held_bytes, x->caller);
  x->held_bytes = 0;
  --in_flight_;
  if (in_flight_ == 0) idle_cv_.notify_all();
}

void RequestPipeline::RecordUndecoded(const char* method, const Status& seen) {
  metrics_.RecordRequest("", method, StatusCodeName(seen.code()), 0);
  LogAccess(method, "", CallTrace(), seen, SteadyClock::now(), nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  last_arrival_ = SteadyClock::now();
}

void RequestPipeline::RecordCall(const std::string& model, const char* method, const Status& st,
                                 SteadyClock::time_point received, const IncomingTrace& in,
                                 const std::string& handle, CallTrace* traced) {
  metrics_.RecordRequest(model, method, StatusCodeName(st.code()), SecondsSince(received));
  if (!tracer_ && !access_log_) return;
  const CallTrace trace = BeginTrace(in);
  if (traced) *traced = trace;
  if (trace.sampled) {
    SpanData span = CallSpan(*tracer_, trace, method, received, SteadyClock::now(), st);
    if (!model.empty()) span.Set("attnserve.model", model);
    if (!handle.empty()) span.Set("attnserve.handle", handle);
    const std::string replica = advertised_address();
    if (!replica.empty()) span.Set("attnserve.replica", replica);
    tracer_->Emit(std::move(span));
  }
  LogAccess(method, model, trace, st, received, nullptr);
}

void RequestPipeline::Observe(const Tracer* tracer, AccessLog* access_log) {
  tracer_ = tracer && tracer->on() ? tracer : nullptr;
  access_log_ = access_log;
}

CallTrace RequestPipeline::BeginTrace(const IncomingTrace& in) const {
  return tracer_ ? tracer_->Begin(in) : CallTrace();
}

void RequestPipeline::Observed(const char* method, const Exchange& x, const Status& seen) const {
  const CallTrace& t = x.trace;
  if (t.sampled) {
    const auto now = SteadyClock::now();
    const Exchange::Times& tm = x.times;
    const SteadyClock::time_point none{};
    const auto admitted = tm.admitted == none ? now : tm.admitted;
    tracer_->Emit(tracer_->ChildOf(t, "attnserve.decode", x.received, admitted));
    if (tm.started != none) {
      tracer_->Emit(tracer_->ChildOf(t, "attnserve.queue", admitted, tm.started));
      SpanData compute = tracer_->ChildOf(t, "attnserve.compute", tm.started, tm.finished);
      compute.Set("attnserve.batch.size", static_cast<int64_t>(tm.batch_size));
      if (!IsZero(tm.batch_span.data(), tm.batch_span.size()))
        compute.links.push_back({tm.batch_trace, tm.batch_span});
      tracer_->Emit(std::move(compute));
    }
    if (tm.answered != none)
      tracer_->Emit(tracer_->ChildOf(t, "attnserve.encode", tm.answered, now));
    SpanData call = CallSpan(*tracer_, t, method, x.received, now, seen);
    const v1::AttendRequest& r = x.request;
    if (!x.model.empty()) call.Set("attnserve.model", x.model);
    if (seen.ok()) {
      call.Set("attnserve.model_version", x.answer.meta.model_version());
      call.Set("attnserve.weights_hash", x.answer.meta.weights_hash());
    }
    call.Set("attnserve.tokens", tm.tokens);
    call.Set("attnserve.dtype", v1::DataType_Name(r.query().dtype()));
    call.Set("attnserve.request_id", static_cast<int64_t>(r.request_id()));
    call.Set("attnserve.previous_attempts", static_cast<int64_t>(tm.attempts));
    call.Set("attnserve.tenant", x.tenant);
    call.Set("attnserve.priority_level", x.level);
    if (!r.session().empty()) call.Set("attnserve.session", r.session());
    if (!r.memory().empty()) call.Set("attnserve.memory", r.memory());
    if (!r.session().empty() || !r.memory().empty()) {
      const std::string replica = advertised_address();
      if (!replica.empty()) call.Set("attnserve.replica", replica);
    }
    tracer_->Emit(std::move(call));
  }
  LogAccess(method, x.model, t, seen, x.received, &x);
}

void RequestPipeline::LogAccess(const char* method, const std::string& model,
                                const CallTrace& trace, const Status& seen,
                                SteadyClock::time_point received, const Exchange* x) const {
  if (!access_log_) return;
  const auto now = SteadyClock::now();
  nlohmann::ordered_json line = {{"time", NowUtc()},
                                 {"method", method},
                                 {"model", model},
                                 {"status", StatusCodeName(seen.code())},
                                 {"total_ms", Millis(received, now)}};
  if (trace.on) {
    line["trace_id"] = Hex(trace.trace_id);
    line["span_id"] = Hex(trace.span_id);
    line["sampled"] = trace.sampled;
  }
  if (!seen.ok()) line["message"] = seen.message();
  if (x) {
    line["request_id"] = x->request.request_id();
    line["tokens"] = x->times.tokens;
    line["tenant"] = x->tenant;
    line["priority_level"] = x->level;
    if (!x->request.session().empty()) line["session"] = x->request.session();
    if (!x->request.memory().empty()) line["memory"] = x->request.memory();
    const SteadyClock::time_point none{};
    if (x->times.started != none) {
      line["batch_size"] = x->times.batch_size;
      line["queue_ms"] = Millis(x->times.admitted, x->times.started);
      line["compute_ms"] = Millis(x->times.started, x->times.finished);
    }
  }
  access_log_->Write(line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
}

void RequestPipeline::ListModels(v1::ListModelsResponse* resp) const {
  const std::shared_ptr<const ModelSet> models = models_.Snapshot();
  for (const auto& [name, versions] : models->models) {
    for (const auto& [version, model] : versions) ToWire(model->spec(), resp->add_models());
  }
}

Status RequestPipeline::GetModel(const v1::GetModelRequest& req, v1::ModelInfo* resp) const {
  ASSIGN_OR_RETURN(auto model,
                   models_.Snapshot()->Lookup(req.name(), req.version(), "name", "version"));
  ToWire(model->spec(), resp);
  return Status::Ok();
}

bool RequestPipeline::Ready(const std::string& model, int64_t version) const {
  if (draining() || warming_.load()) return false;
  const std::shared_ptr<const ModelSet> models = models_.Snapshot();
  return model.empty() ? !models->models.empty() : models->Find(model, version) != nullptr;
}

StatusOr<ModelSpec> RequestPipeline::Describe(const std::string& model, int64_t version,
                                              std::vector<int64_t>* versions) const {
  const std::shared_ptr<const ModelSet> models = models_.Snapshot();
  ASSIGN_OR_RETURN(auto found, models->Lookup(model, version, "name", "version"));
  versions->clear();
  for (const auto& [v, m] : models->models.at(model)) versions->push_back(v);
  return found->spec();
}

void RequestPipeline::SetAdvertisedAddress(std::string address) {
  std::lock_guard<std::mutex> lock(mu_);
  advertised_ = std::move(address);
}

std::string RequestPipeline::advertised_address() const {
  std::lock_guard<std::mutex> lock(mu_);
  return advertised_;
}

void RequestPipeline::CreateMemory(const v1::CreateMemoryRequest& req, CallContext call,
                                   v1::KvHandle* resp,
                                   std::function<void(const Status&, const CallTrace&)> done) {
  const auto received = SteadyClock::now();
  auto item = std::make_unique<WorkItem>();
  item->accepted = received;
  item->deadline = call.deadline;
  item->cancelled = std::move(call.cancelled);
  const IncomingTrace trace = call.trace;
  const std::string caller = CallerOf(call);
  item->tenant = caller;  // Its place in the fair shares: its caller's, as its Attend calls'.
  std::shared_ptr<KvEntry> entry;
  int64_t held = 0;  // The request's bytes, in the in-flight budget until it is done.
  const Status st = [&]() -> Status {
    ASSIGN_OR_RETURN(item->model, models_.Snapshot()->Lookup(req.model(), req.model_version()));
    RETURN_IF_ERROR(FromWire(req, &item->call));
    RETURN_IF_ERROR(ValidateCreateMemory(item->model->spec(), limits_, &item->call));
    ASSIGN_OR_RETURN(item->call.kv, NewKvCacheOf(*item->model));
    const int64_t bytes = WidenedBytes(static_cast<int64_t>(req.ByteSizeLong()),
                                       item->call.key->dtype, item->model->spec().compute_dtype);
    RETURN_IF_ERROR(Reserve(item->model->spec().name, bytes, caller));
    held = bytes;
    ASSIGN_OR_RETURN(entry, kv_.Create(KvKind::kMemory, item->model, item->call.kv,
                                       item->call.batch, item->call.key_len, call.tenant));
    return Status::Ok();
  }();
  const std::string name = item->model ? item->model->spec().name : "";
  if (!st.ok()) {
    Unreserve(held, caller);
    CallTrace traced;
    RecordCall(name, "CreateMemory", st, received, trace, "", &traced);
    done(st, traced);
    return;
  }
  item->kv_entry = entry;
  const int64_t length = item->call.key_len;
  item->done = [this, name, received, trace, entry = std::move(entry), length, held, caller, resp,
                done = std::move(done)](Status st, const WorkItem&) mutable {
    Unreserve(held, caller);
    if (st.ok()) st = kv_.MarkReady(entry, length);
    if (st.ok()) {
      FillHandle(*entry, length, kv_, advertised_address(), resp);
    } else {
      kv_.Discard(entry);
    }
    const std::string handle = entry->handle;
    entry.reset();  // Not held once told: the client's next call may evict it.
    CallTrace traced;
    RecordCall(name, "CreateMemory", st, received, trace, handle, &traced);
    done(st, traced);
  };
  batcher_.Submit(std::move(item));
}

Status RequestPipeline::OpenSession(const v1::OpenSessionRequest& req, v1::KvHandle* resp,
                                    const KvCaller& caller, CallTrace* traced) {
  const IncomingTrace& trace = caller.trace;
  const auto received = SteadyClock::now();
  std::shared_ptr<const AttentionModel> model;
  const Status st = [&]() -> Status {
    ASSIGN_OR_RETURN(model, models_.Snapshot()->Lookup(req.model(), req.model_version()));
    if (req.batch() < 1 || req.batch() > limits_.max_tokens) {
      return InvalidArgument("batch: " + std::to_string(req.batch()) + "; allowed: 1 to " +
                             std::to_string(limits_.max_tokens) +
                             " (server flag --max-request-tokens)");
    }
    const ModelSpec& m = model->spec();
    if (m.kdim != m.embed_dim || m.vdim != m.embed_dim) {
      return InvalidArgument(
          "model: '" + m.name + "' has kdim=" + std::to_string(m.kdim) +
          ", vdim=" + std::to_string(m.vdim) + " != embed_dim=" + std::to_string(m.embed_dim) +
          "; a decoding session is self-attention, which needs kdim = vdim = embed_dim");
    }
    ASSIGN_OR_RETURN(std::shared_ptr<KvCache> cache, NewKvCacheOf(*model));
    ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> entry,
                     kv_.Create(KvKind::kSession, model, cache, req.batch(), 0, caller.tenant));
    FillHandle(*entry, 0, kv_, advertised_address(), resp);
    return Status::Ok();
  }();
  RecordCall(model ? model->spec().name : "", "OpenSession", st, received, trace, resp->handle(),
             traced);
  return st;
}

Status RequestPipeline::ForkSession(const v1::ForkSessionRequest& req, v1::KvHandle* resp,
                                    const KvCaller& caller, CallTrace* traced) {
  const IncomingTrace& trace = caller.trace;
  const auto received = SteadyClock::now();
  std::string model;
  const Status st = [&]() -> Status {
    ASSIGN_OR_RETURN(std::shared_ptr<KvEntry> child,
                     kv_.Fork(
                         req.handle(),
                         [&model](const AttentionModel& parent_model) {
                           model = parent_model.spec().name;
                           return NewKvCacheOf(parent_model);
                         },
                         caller.tenant));
    FillHandle(*child, std::nullopt, kv_, advertised_address(), resp);
    return Status::Ok();
  }();
  RecordCall(model, "ForkSession", st, received, trace, req.handle(), traced);
  return st;
}

Status RequestPipeline::TruncateSession(const v1::TruncateSessionRequest& req, v1::KvHandle* resp,
                                        const KvCaller& caller, CallTrace* traced) {
  const IncomingTrace& trace = caller.trace;
  const auto received = SteadyClock::now();
  std::string model;
  const Status st = [&]() -> Status {
    std::shared_ptr<KvEntry> entry;
    RETURN_IF_ERROR(kv_.Truncate(req.handle(), req.length(), caller.tenant, &entry));
    model = entry->model->spec().name;
    FillHandle(*entry, req.length(), kv_, advertised_address(), resp);
    return Status::Ok();
  }();
  RecordCall(model, "TruncateSession", st, received, trace, req.handle(), traced);
  return st;
}

Status RequestPipeline::Release(const char* method, KvKind kind, const v1::ReleaseRequest& req,
                                v1::ReleaseResponse* resp, const KvCaller& caller,
                                CallTrace* traced) {
  const IncomingTrace& trace = caller.trace;
  const auto received = SteadyClock::now();
  StatusOr<int64_t> freed = kv_.Release(req.handle(), kind, caller.tenant);
  if (freed.ok()) resp->set_bytes_freed(*freed);
  RecordCall("", method, freed.status(), received, trace, req.handle(), traced);
  return freed.status();
}

void RequestPipeline::AddCall(OpenCall* call) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.insert(call);
  last_arrival_ = SteadyClock::now();
}

void RequestPipeline::RemoveCall(OpenCall* call) {
  std::lock_guard<std::mutex> lock(mu_);
  calls_.erase(call);
  if (calls_.empty()) idle_cv_.notify_all();
}

void RequestPipeline::BeginDrain() {
  draining_ = true;
  std::vector<OpenCall*> finish;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (OpenCall* c : calls_) {
      if (c->Drain()) finish.push_back(c);
    }
  }
  // Outside mu_: a finished call's end removes it from calls_. It cannot be gone before FinishNow,
  // which is the only finish it will get.
  for (OpenCall* c : finish) c->FinishNow();
}

bool RequestPipeline::WaitIdle(SteadyClock::time_point deadline, SteadyClock::duration quiet) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const bool idle = in_flight_ == 0 && calls_.empty();
    const auto quiet_since = last_arrival_ + quiet;
    const auto now = SteadyClock::now();
    if (idle && now >= quiet_since) return true;
    if (now >= deadline) return false;
    // In-flight work notifies when it ends; a quiet period just needs time to pass.
    idle_cv_.wait_until(lock, std::min(deadline, idle ? quiet_since : now + quiet));
  }
}

}  // namespace attnserve
