// A batched step (AttendRequest.steps): one call carrying one step for each of many sessions (or
// one query for each of many memories). Its entries are resolved together, computed as one item
// of the batch (WorkItem::entries) and answered one by one; an entry refused or failed changes
// nothing and the others go on (docs/api.md "Many sessions in one call").
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/core/validator.h"
#include "server/core/wire.h"
#include "server/pipeline/request_pipeline.h"

namespace attnserve {
namespace {

// `st` with `field` ("steps[3]") in front of its message, so a caller knows which entry it is.
Status Named(const std::string& field, const Status& st) {
  return Status(st.code(), field + ": " + st.message());
}

// What one entry's answer may add to the message besides its output: its fields and prefixes,
// and an error's message (at most kMaxStatusMessage).
constexpr int64_t kStepAnswerOverhead = static_cast<int64_t>(kMaxStatusMessage) + 128;

std::string ModelName(const ModelSpec& spec) {
  return "model '" + spec.name + "' version " + std::to_string(spec.version);
}

}  // namespace

void StepsHeld::End(bool delivered, const std::vector<Status>& outcome) {
  for (size_t i = 0; i < kv.size(); ++i) {
    if (kv[i]) kv[i]->End(delivered && i < outcome.size() && outcome[i].ok());
  }
  kv.clear();  // Idle and not held: the client's next call may evict them.
}

namespace {

// A batched step's entries while they are resolved: each one's call, field name ("steps[3]") and
// memory or session, and what is held (the steps begun, the refusals).
struct Resolving {
  const v1::AttendRequest& r;
  StepsHeld* held;
  std::vector<AttendCall> calls;
  std::vector<std::string> field;
  std::vector<std::shared_ptr<KvEntry>> entries;
  bool ok(int i) const { return held->refused[i].ok(); }
  void Refuse(int i, const Status& st) { held->refused[i] = Named(field[i], st); }
};

// The entries decoded, a session named twice refused after its first, and the sessions to begin.
void DecodeEntries(Resolving& e, std::vector<KvStore::StepBegin>* begins,
                   std::vector<int>* begun_entry) {
  std::unordered_map<std::string, int> first;  // Each session's first entry.
  for (int i = 0; i < e.r.steps_size(); ++i) {
    const v1::Step& s = e.r.steps(i);
    e.field[i] = "steps[" + std::to_string(i) + "]";
    e.held->refused[i] = FromWire(s, e.field[i], &e.calls[i]);
    if (!e.ok(i) || s.session().empty()) continue;  // A memory: read, never stepped.
    const auto [at, fresh] = first.emplace(s.session(), i);
    if (!fresh) {
      e.Refuse(i,
               Status(StatusCode::kAborted, "session '" + s.session() + "' is stepped by steps[" +
                                                std::to_string(at->second) +
                                                "] of this call already; one step per session "
                                                "in a call"));
      continue;
    }
    begins->push_back({s.session(), s.has_session_length()
                                        ? std::optional<int64_t>(s.session_length())
                                        : std::nullopt});
    begun_entry->push_back(i);
  }
}

// Every session marked busy under one lock before any reserves room (KvStore::BeginSteps), then
// the memories looked up.
void BeginEntries(Resolving& e, KvStore& kv, const std::string& tenant) {
  std::vector<KvStore::StepBegin> begins;
  std::vector<int> begun_entry;
  DecodeEntries(e, &begins, &begun_entry);
  std::vector<StatusOr<std::unique_ptr<KvStep>>> begun = kv.BeginSteps(begins, tenant);
  for (size_t j = 0; j < begun.size(); ++j) {
    const int i = begun_entry[j];
    if (!begun[j].ok()) {
      e.Refuse(i, begun[j].status());
      continue;
    }
    e.held->kv[i] = std::move(begun[j]).value();
    e.entries[i] = e.held->kv[i]->entry();
    e.calls[i].kv_use = AttendCall::Kv::kSession;
    e.calls[i].kv_length = e.held->kv[i]->length();
  }
  for (int i = 0; i < e.r.steps_size(); ++i) {
    if (!e.ok(i) || e.r.steps(i).memory().empty()) continue;
    StatusOr<std::shared_ptr<KvEntry>> memory =
        kv.Lookup(e.r.steps(i).memory(), KvKind::kMemory, tenant);
    if (!memory.ok()) {
      e.Refuse(i, memory.status());
      continue;
    }
    e.entries[i] = std::move(memory).value();
    e.calls[i].kv_use = AttendCall::Kv::kMemory;
    e.calls[i].kv_length = e.entries[i]->length;
  }
}

// Why entry i's model is not the call's (the request's when it names one, else the first entry's
// `model`); OK when it is.
Status SameModel(const Resolving& e, int i, const AttentionModel* model) {
  const KvEntry& entry = *e.entries[i];
  const ModelSpec& spec = entry.model->spec();
  const std::string what = std::string(entry.kind == KvKind::kSession ? "session" : "memory") +
                           " '" + entry.handle + "' belongs to " + ModelName(spec);
  if ((!e.r.model().empty() && e.r.model() != spec.name) ||
      (e.r.model_version() != 0 && e.r.model_version() != spec.version)) {
    return InvalidArgument(what + ", but the call names model '" + e.r.model() + "' version " +
                           std::to_string(e.r.model_version()) +
                           " (leave model empty and model_version 0 to use the entries')");
  }
  if (model && entry.model.get() != model) {
    return InvalidArgument(what + " (weights " + spec.weights_hash + "), but the call's first " +
                           "entry to " + ModelName(model->spec()) + " (weights " +
                           model->spec().weights_hash +
                           "); one call steps the sessions of one model version");
  }
  return Status::Ok();
}

// Each entry against the call's model and dtype, then validated as a single request of its own;
// the call's model (null when no entry got that far).
std::shared_ptr<const AttentionModel> CheckEntries(Resolving& e, const AttendLimits& limits,
                                                   std::optional<DType>* dtype) {
  std::shared_ptr<const AttentionModel> model;
  for (int i = 0; i < e.r.steps_size(); ++i) {
    if (!e.ok(i)) continue;
    Status st = SameModel(e, i, model.get());
    if (st.ok()) {
      if (!model) model = e.entries[i]->model;
      AttendCall& c = e.calls[i];
      c.kv = e.entries[i]->cache;
      c.kv_batch = e.entries[i]->batch;
      st = Validate(model->spec(), limits, &c);
      if (st.ok() && *dtype && c.query.dtype != **dtype) {
        st = InvalidArgument(std::string("query: dtype ") + DTypeName(c.query.dtype) +
                             ", but the call's first entry's is " + DTypeName(**dtype) +
                             "; one call's entries share a dtype");
      }
      if (st.ok()) *dtype = c.query.dtype;
    }
    if (!st.ok()) e.Refuse(i, st);
  }
  return model;
}

// The call is one request for the per-request limits: its entries' tokens, attention scores and
// answers together.
Status CheckCallLimits(const Resolving& e, const AttendLimits& limits) {
  int64_t tokens = 0, scores = 0, answer = 0;
  for (int i = 0; i < e.r.steps_size(); ++i) {
    if (!e.ok(i)) continue;
    const ModelSpec& spec = e.entries[i]->model->spec();
    const AttendCall& c = e.calls[i];
    const int64_t entry_scores =
        c.batch * spec.num_heads * c.query_len * (c.key_len + spec.extra_keys());
    for (auto [sum, add] : {std::pair<int64_t*, int64_t>{&tokens, c.tokens},
                            {&scores, entry_scores},
                            {&answer, c.output_bytes}}) {
      if (__builtin_add_overflow(*sum, add, sum)) *sum = INT64_MAX;  // Saturates: refused below.
    }
  }
  if (tokens > limits.max_tokens) {
    return InvalidArgument("steps: " + std::to_string(tokens) +
                           " tokens in all; allowed: at most " + std::to_string(limits.max_tokens) +
                           " in one call (server flag --max-request-tokens)");
  }
  if (scores > limits.max_attention_scores) {
    return InvalidArgument("steps: " + std::to_string(scores) +
                           " attention scores in all (batch * num_heads * query_len * key_len of "
                           "each entry); allowed: at most " +
                           std::to_string(limits.max_attention_scores) +
                           " in one call (server flag --max-attention-scores)");
  }
  // Room for every entry's fields and an error message of the longest kind, whatever happens.
  const int64_t overhead = int64_t{e.r.steps_size()} * kStepAnswerOverhead;
  if (__builtin_add_overflow(answer, overhead, &answer)) answer = INT64_MAX;
  if (answer > limits.max_answer_bytes) {
    return InvalidArgument("steps: the answers take " + std::to_string(answer) +
                           " bytes; allowed: at most " + std::to_string(limits.max_answer_bytes) +
                           " in one message (server flag --max-message-bytes)");
  }
  return Status::Ok();
}

// Room for each session's new tokens, every session of the call busy already (not evictable).
void ReserveEntries(Resolving& e) {
  for (int i = 0; i < e.r.steps_size(); ++i) {
    if (!e.ok(i) || !e.held->kv[i]) continue;
    const Status reserved = e.held->kv[i]->Reserve(e.calls[i].query_len);
    if (!reserved.ok()) {
      e.Refuse(i, reserved);
      e.held->kv[i].reset();  // Ended, not applied: the session is as it was.
      continue;
    }
    e.calls[i].kv_capacity = e.held->kv[i]->capacity();
  }
}

// The entries that passed as one item of the batch; what the queue reads of it summed.
void FillItem(Resolving& e, std::shared_ptr<const AttentionModel> model, DType dtype,
              WorkItem* item) {
  auto kept = std::make_shared<std::vector<std::shared_ptr<KvEntry>>>();
  for (int i = 0; i < e.r.steps_size(); ++i) {
    if (!e.ok(i)) continue;
    e.held->computed[i] = static_cast<int>(item->entries.size());
    item->call.tokens += e.calls[i].tokens;  // Within the limits checked: no overflow.
    item->call.attention_cost += e.calls[i].attention_cost;
    item->call.output_bytes += e.calls[i].output_bytes;
    item->entries.push_back({std::move(e.calls[i]), AttendOutputs(), Status::Ok()});
    kept->push_back(std::move(e.entries[i]));
  }
  item->model = std::move(model);
  item->kv_entry = std::move(kept);
  item->call.query.dtype = dtype;
  item->call.weights = WeightsMode::kNone;
}

}  // namespace

Status RequestPipeline::ResolveSteps(Exchange* x, WorkItem* item, StepsHeld* held) {
  const v1::AttendRequest& r = x->request;
  RETURN_IF_ERROR(CheckBatchedStep(r));
  if (r.model_version() < 0) {
    return InvalidArgument("model_version: " + std::to_string(r.model_version()) +
                           "; allowed: 0 (the entries' own) or their version");
  }
  const int n = r.steps_size();
  if (n > limits_.max_steps) {
    return InvalidArgument("steps: " + std::to_string(n) + " entries; allowed: at most " +
                           std::to_string(limits_.max_steps) +
                           " (server flag --max-steps-per-call)");
  }
  held->refused.assign(n, Status::Ok());
  held->kv.resize(n);
  held->computed.assign(n, -1);
  Resolving e{r, held, std::vector<AttendCall>(n), std::vector<std::string>(n),
              std::vector<std::shared_ptr<KvEntry>>(n)};
  BeginEntries(e, kv_, x->tenant);
  std::optional<DType> dtype;
  std::shared_ptr<const AttentionModel> model = CheckEntries(e, limits_, &dtype);
  RETURN_IF_ERROR(CheckCallLimits(e, limits_));
  ReserveEntries(e);
  x->model = model ? model->spec().name : "";
  FillItem(e, std::move(model), dtype.value_or(DType::kFloat32), item);
  return Status::Ok();
}

void RequestPipeline::AnswerSteps(Exchange* x, const StepsHeld& held, const WorkItem* w,
                                  uint32_t previous_attempts) {
  AttendAnswer& a = x->answer;
  v1::AttendResponse& meta = a.meta;
  meta.set_request_id(x->request.request_id());
  if (w && w->model) {
    const ModelSpec& spec = w->model->spec();
    meta.set_model(spec.name);
    meta.set_weights_hash(spec.weights_hash);
    meta.set_model_version(spec.version);
    auto* timing = meta.mutable_timing();
    timing->set_queue_seconds(w->queue_seconds);
    timing->set_compute_seconds(w->compute_seconds);
    timing->set_batch_size(static_cast<uint32_t>(w->batch_size));
  }
  meta.mutable_timing()->set_previous_attempts(previous_attempts);
  const size_t n = held.computed.size();
  a.step_status.assign(n, Status::Ok());
  a.step_output.resize(n);
  for (size_t i = 0; i < n; ++i) {
    v1::StepResult* result = meta.add_steps();
    const int k = held.computed[i];
    if (k < 0 || !w) {
      a.step_status[i] = held.refused[i];
      continue;
    }
    const WorkItem::Entry& e = w->entries[static_cast<size_t>(k)];
    if (!e.status.ok()) {
      a.step_status[i] =
          Status(e.status.code(), "steps[" + std::to_string(i) + "]: " + e.status.message());
      continue;
    }
    v1::Tensor* out = result->mutable_output();
    out->set_dtype(ToWire(e.call.query.dtype));
    out->mutable_shape()->Assign(e.call.output_shape.begin(), e.call.output_shape.end());
    if (e.call.kv_use == AttendCall::Kv::kSession)
      result->set_session_length(e.call.kv_length + e.call.query_len);
    a.step_output[i].block = e.outputs.output_block;
  }
}

void RequestPipeline::SubmitSteps(Exchange* x, std::unique_ptr<WorkItem> item,
                                  std::shared_ptr<StepsHeld> held, uint32_t previous_attempts,
                                  std::function<void(const Status&)> finish) {
  if (item->entries.empty()) {
    AnswerSteps(x, *held, nullptr, previous_attempts);
    finish(Status::Ok());
    return;
  }
  // The engine writes each entry's output straight into its answer bytes.
  x->answer.step_output.resize(held->computed.size());
  for (size_t i = 0; i < held->computed.size(); ++i) {
    if (held->computed[i] < 0) continue;
    x->answer.step_output[i].own = std::make_unique<std::string>();
    item->entries[static_cast<size_t>(held->computed[i])].outputs.output =
        x->answer.step_output[i].own.get();
  }
  item->done = [x, held, previous_attempts, finish = std::move(finish)](const Status& st,
                                                                        const WorkItem& w) mutable {
    if (st.ok()) AnswerSteps(x, *held, &w, previous_attempts);
    Computed(x, w);
    finish(st);
  };
  batcher_.Submit(std::move(item));
}

}  // namespace attnserve
