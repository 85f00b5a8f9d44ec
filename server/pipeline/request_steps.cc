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

void RequestPipeline::StepsHeld::End(bool delivered, const std::vector<Status>& outcome) {
  for (size_t i = 0; i < kv.size(); ++i) {
    if (kv[i]) kv[i]->End(delivered && i < outcome.size() && outcome[i].ok());
  }
  kv.clear();  // Idle and not held: the client's next call may evict them.
}

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
  std::vector<AttendCall> calls(static_cast<size_t>(n));
  std::vector<std::string> field(static_cast<size_t>(n));
  held->refused.assign(n, Status::Ok());
  held->kv.resize(n);
  held->computed.assign(n, -1);
  // Every session is marked busy under one lock before any reserves room (KvStore::BeginSteps).
  std::vector<KvStore::StepBegin> begins;
  std::vector<int> begun_entry;
  std::unordered_map<std::string, int> first;  // Each handle's first entry.
  for (int i = 0; i < n; ++i) {
    const v1::Step& s = r.steps(i);
    field[i] = "steps[" + std::to_string(i) + "]";
    held->refused[i] = FromWire(s, field[i], &calls[i]);
    if (!held->refused[i].ok()) continue;
    if (s.session().empty()) continue;  // A memory: read, never stepped; named as often as wanted.
    const std::string& handle = s.session();
    const auto [at, fresh] = first.emplace(handle, i);
    if (!fresh) {
      held->refused[i] = Status(StatusCode::kAborted,
                                field[i] + ": session '" + handle + "' is stepped by steps[" +
                                    std::to_string(at->second) +
                                    "] of this call already; one step per session in a call");
      continue;
    }
    begins.push_back({s.session(), s.has_session_length()
                                       ? std::optional<int64_t>(s.session_length())
                                       : std::nullopt});
    begun_entry.push_back(i);
  }
  std::vector<StatusOr<std::unique_ptr<KvStep>>> begun = kv_.BeginSteps(begins, x->tenant);
  std::vector<std::shared_ptr<KvEntry>> entries(static_cast<size_t>(n));
  for (size_t j = 0; j < begun.size(); ++j) {
    const int i = begun_entry[j];
    if (!begun[j].ok()) {
      held->refused[i] = Named(field[i], begun[j].status());
      continue;
    }
    held->kv[i] = std::move(begun[j]).value();
    entries[i] = held->kv[i]->entry();
    calls[i].kv_use = AttendCall::Kv::kSession;
    calls[i].kv_length = held->kv[i]->length();
  }
  for (int i = 0; i < n; ++i) {
    if (!held->refused[i].ok() || r.steps(i).memory().empty()) continue;
    StatusOr<std::shared_ptr<KvEntry>> memory =
        kv_.Lookup(r.steps(i).memory(), KvKind::kMemory, x->tenant);
    if (!memory.ok()) {
      held->refused[i] = Named(field[i], memory.status());
      continue;
    }
    entries[i] = std::move(memory).value();
    calls[i].kv_use = AttendCall::Kv::kMemory;
    calls[i].kv_length = entries[i]->length;
  }
  // One model version and one query dtype for the whole call: the request's model when it names
  // one, else the first entry's.
  std::shared_ptr<const AttentionModel> model;
  std::optional<DType> dtype;
  for (int i = 0; i < n; ++i) {
    Status& st = held->refused[i];
    if (!st.ok()) continue;
    const std::shared_ptr<const AttentionModel>& m = entries[i]->model;
    const ModelSpec& spec = m->spec();
    const char* kind = entries[i]->kind == KvKind::kSession ? "session" : "memory";
    if ((!r.model().empty() && r.model() != spec.name) ||
        (r.model_version() != 0 && r.model_version() != spec.version)) {
      st = InvalidArgument(field[i] + ": " + kind + " '" + entries[i]->handle + "' belongs to " +
                           ModelName(spec) + ", but the call names model '" + r.model() +
                           "' version " + std::to_string(r.model_version()) +
                           " (leave model empty and model_version 0 to use the entries')");
    } else if (model && m != model) {
      st = InvalidArgument(field[i] + ": " + kind + " '" + entries[i]->handle + "' belongs to " +
                           ModelName(spec) + " (weights " + spec.weights_hash +
                           "), but the call's first entry to " + ModelName(model->spec()) +
                           " (weights " + model->spec().weights_hash +
                           "); one call steps the sessions of one model version");
    }
    if (!st.ok()) continue;
    if (!model) model = m;
    AttendCall& c = calls[i];
    c.kv = entries[i]->cache;
    c.kv_batch = entries[i]->batch;
    st = Validate(spec, limits_, &c);
    if (!st.ok()) {
      st = Named(field[i], st);
    } else if (dtype && c.query.dtype != *dtype) {
      st = InvalidArgument(field[i] + ".query: dtype " + DTypeName(c.query.dtype) +
                           ", but the call's first entry's is " + DTypeName(*dtype) +
                           "; one call's entries share a dtype");
    } else {
      dtype = c.query.dtype;
    }
  }
  // The call is one request for the per-request limits: its entries' tokens and attention scores
  // together.
  int64_t tokens = 0, scores = 0, answer = 0;
  for (int i = 0; i < n; ++i) {
    if (!held->refused[i].ok()) continue;
    const ModelSpec& spec = entries[i]->model->spec();
    const int64_t entry_scores = calls[i].batch * spec.num_heads * calls[i].query_len *
                                 (calls[i].key_len + spec.extra_keys());
    for (auto [sum, add] : {std::pair<int64_t*, int64_t>{&tokens, calls[i].tokens},
                            {&scores, entry_scores},
                            {&answer, calls[i].output_bytes}}) {
      if (__builtin_add_overflow(*sum, add, sum)) *sum = INT64_MAX;  // Saturates: refused below.
    }
  }
  if (tokens > limits_.max_tokens) {
    return InvalidArgument("steps: " + std::to_string(tokens) +
                           " tokens in all; allowed: at most " + std::to_string(limits_.max_tokens) +
                           " in one call (server flag --max-request-tokens)");
  }
  if (scores > limits_.max_attention_scores) {
    return InvalidArgument("steps: " + std::to_string(scores) +
                           " attention scores in all (batch * num_heads * query_len * key_len of "
                           "each entry); allowed: at most " +
                           std::to_string(limits_.max_attention_scores) +
                           " in one call (server flag --max-attention-scores)");
  }
  // Room for every entry's fields and an error message of the longest kind, whatever happens.
  if (__builtin_add_overflow(answer, int64_t{n} * kStepAnswerOverhead, &answer)) answer = INT64_MAX;
  if (answer > limits_.max_answer_bytes) {
    return InvalidArgument("steps: the answers take " + std::to_string(answer) +
                           " bytes; allowed: at most " + std::to_string(limits_.max_answer_bytes) +
                           " in one message (server flag --max-message-bytes)");
  }
  // Room for each session's new tokens, every session of the call already busy (not evictable).
  for (int i = 0; i < n; ++i) {
    if (!held->refused[i].ok() || !held->kv[i]) continue;
    const Status reserved = held->kv[i]->Reserve(calls[i].query_len);
    if (!reserved.ok()) {
      held->refused[i] = Named(field[i], reserved);
      held->kv[i].reset();  // Ended, not applied: the session is as it was.
      continue;
    }
    calls[i].kv_capacity = held->kv[i]->capacity();
  }
  auto kept = std::make_shared<std::vector<std::shared_ptr<KvEntry>>>();
  tokens = 0;
  int64_t attention = 0;  // Within --max-attention-scores (checked above), so no overflow.
  for (int i = 0; i < n; ++i) {
    if (!held->refused[i].ok()) continue;
    held->computed[i] = static_cast<int>(item->entries.size());
    tokens += calls[i].tokens;
    attention += calls[i].attention_cost;
    item->call.output_bytes += calls[i].output_bytes;
    item->entries.push_back({std::move(calls[i]), AttendOutputs(), Status::Ok()});
    kept->push_back(std::move(entries[i]));
  }
  item->model = model;
  item->kv_entry = std::move(kept);
  item->call.query.dtype = dtype.value_or(DType::kFloat32);
  item->call.weights = WeightsMode::kNone;
  item->call.tokens = tokens;
  item->call.attention_cost = attention;
  x->model = model ? model->spec().name : "";
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
      a.step_status[i] = Status(e.status.code(), "steps[" + std::to_string(i) + "]: " +
                                                     e.status.message());
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
  item->done = [x, held, previous_attempts, finish = std::move(finish)](
                   const Status& st, const WorkItem& w) mutable {
    if (st.ok()) AnswerSteps(x, *held, &w, previous_attempts);
    Computed(x, w);
    finish(st);
  };
  batcher_.Submit(std::move(item));
}

}  // namespace attnserve
