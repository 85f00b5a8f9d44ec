#include "server/attention_service.h"

#include <deque>
#include <iostream>
#include <mutex>

#include "server/grpc_status.h"
#include "server/validator.h"
#include "server/wire.h"

namespace attnserve {
namespace {

double SecondsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

// The call's deadline on the steady clock (max when the client set none).
SteadyClock::time_point DeadlineOf(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return SteadyClock::time_point::max();
  return SteadyClock::now() + (deadline - std::chrono::system_clock::now());
}

void SetTensorMeta(v1::Tensor* t, DType dtype, const std::vector<int64_t>& shape) {
  t->set_dtype(ToWire(dtype));
  t->mutable_shape()->Assign(shape.begin(), shape.end());
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const ModelMap& models, Batcher& batcher,
                                           ServerMetrics& metrics, const AttendLimits& limits)
    : models_(models), batcher_(batcher), metrics_(metrics), limits_(limits) {}

void AttentionServiceImpl::Dispatch(const char* method, const v1::AttendRequest& request,
                                    v1::AttendResponse* response,
                                    SteadyClock::time_point deadline,
                                    std::function<bool()> cancelled,
                                    std::function<void(const Status&)> done) {
  const auto received = SteadyClock::now();
  metrics_.AddInFlight(method, 1);
  auto it = models_.find(request.model());
  const std::string model_label = it == models_.end() ? "" : it->first;
  auto finish = [this, method, received, model_label, done = std::move(done)](const Status& st) {
    if (st.code() == StatusCode::kInternal) std::cerr << "attnserve: " << st.ToString() << "\n";
    metrics_.RecordRequest(model_label, method, GrpcCodeName(st), SecondsSince(received));
    metrics_.AddInFlight(method, -1);
    done(st);
  };

  response->set_request_id(request.request_id());
  if (it == models_.end()) {
    std::string names;
    for (const auto& [name, m] : models_) names += (names.empty() ? "" : ", ") + name;
    finish(NotFound("model: '" + request.model() + "' is not loaded; available: " + names));
    return;
  }
  auto item = std::make_unique<WorkItem>();
  item->model = it->second.get();
  item->accepted = received;
  item->deadline = deadline;
  item->cancelled = std::move(cancelled);
  Status st = FromWire(request, &item->call);
  if (st.ok()) st = Validate(item->model->spec(), limits_, &item->call);
  if (!st.ok()) {
    finish(st);
    return;
  }
  item->outputs.output = response->mutable_output()->mutable_data();
  if (item->call.weights != WeightsMode::kNone) {
    item->outputs.weights = response->mutable_attn_weights()->mutable_data();
  }
  item->done = [this, response, finish = std::move(finish)](const Status& st, const WorkItem& w) {
    if (st.ok()) {
      const ModelSpec& spec = w.model->spec();
      response->set_model(spec.name);
      response->set_weights_hash(spec.weights_hash);
      SetTensorMeta(response->mutable_output(), w.call.query.dtype, w.outputs.output_shape);
      if (w.outputs.weights) {
        SetTensorMeta(response->mutable_attn_weights(), w.call.query.dtype, w.outputs.weights_shape);
      }
      auto* timing = response->mutable_timing();
      timing->set_queue_seconds(w.queue_seconds);
      timing->set_compute_seconds(w.compute_seconds);
      timing->set_batch_size(static_cast<uint32_t>(w.batch_size));
    } else {
      response->clear_output();
      response->clear_attn_weights();
    }
    finish(st);
  };
  batcher_.Submit(std::move(item));
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* ctx,
                                                       const v1::AttendRequest* req,
                                                       v1::AttendResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  Dispatch("Attend", *req, resp, DeadlineOf(ctx), [ctx] { return ctx->IsCancelled(); },
           [reactor](const Status& st) { reactor->Finish(ToGrpcStatus(st)); });
  return reactor;
}

// Reads requests as they come, dispatches each at once and writes each response as soon as it is
// computed, one write at a time: responses leave in completion order. Finishes once the client has
// half-closed and every request has been answered.
class AttentionServiceImpl::StreamReactor final
    : public grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse> {
 public:
  StreamReactor(AttentionServiceImpl* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    StartNextRead();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      std::lock_guard<std::mutex> lock(mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    Slot* slot = reading_.release();
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++pending_;
    }
    service_->Dispatch("AttendStream", slot->request, &slot->response, DeadlineOf(ctx_),
                       [this] { return ctx_->IsCancelled(); },
                       [this, slot](const Status& st) { OnComputed(slot, st); });
    StartNextRead();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    delete writes_.front();
    writes_.pop_front();
    --pending_;
    if (!ok) broken_ = true;  // The client is gone: drop what remains, but wait for compute.
    WriteNextLocked();
    MaybeFinishLocked();
  }

  void OnDone() override { delete this; }

 private:
  struct Slot {
    v1::AttendRequest request;
    v1::AttendResponse response;
  };

  void StartNextRead() {
    reading_ = std::make_unique<Slot>();
    StartRead(&reading_->request);
  }

  void OnComputed(Slot* slot, const Status& st) {
    if (!st.ok()) {
      slot->response.mutable_error()->set_code(static_cast<int>(ToGrpcCode(st.code())));
      slot->response.mutable_error()->set_message(st.message());
    }
    std::lock_guard<std::mutex> lock(mu_);
    writes_.push_back(slot);
    if (!writing_) WriteNextLocked();
  }

  void WriteNextLocked() {
    while (!writes_.empty() && broken_) {
      delete writes_.front();
      writes_.pop_front();
      --pending_;
    }
    writing_ = !writes_.empty();
    if (writing_) StartWrite(&writes_.front()->response);
  }

  void MaybeFinishLocked() {
    if (reads_done_ && pending_ == 0 && !writing_ && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  AttentionServiceImpl* service_;
  grpc::CallbackServerContext* ctx_;
  std::unique_ptr<Slot> reading_;  // Only touched by the read chain, one read at a time.
  std::mutex mu_;
  std::deque<Slot*> writes_;  // Computed, waiting to be written; front is being written.
  int pending_ = 0;           // Dispatched and not yet written (or dropped).
  bool reads_done_ = false;
  bool writing_ = false;
  bool broken_ = false;
  bool finished_ = false;
};

grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(this, ctx);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* ctx,
                                                           const v1::ListModelsRequest*,
                                                           v1::ListModelsResponse* resp) {
  for (const auto& [name, model] : models_) ToWire(model->spec(), resp->add_models());
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* ctx,
                                                         const v1::GetModelRequest* req,
                                                         v1::ModelInfo* resp) {
  auto* reactor = ctx->DefaultReactor();
  auto it = models_.find(req->name());
  if (it == models_.end()) {
    reactor->Finish(ToGrpcStatus(NotFound("name: model '" + req->name() + "' is not loaded")));
  } else {
    ToWire(it->second->spec(), resp);
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

}  // namespace attnserve
