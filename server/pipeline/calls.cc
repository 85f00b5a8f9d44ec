#include "server/pipeline/calls.h"

#include <utility>

#include "server/pipeline/request_pipeline.h"

namespace attnserve {

void Exchange::ReleaseInputs() {
  for (v1::Tensor* t : {request.mutable_query(), request.mutable_key(), request.mutable_value(),
                        request.mutable_key_padding_mask(), request.mutable_attn_mask()}) {
    std::string().swap(*t->mutable_data());
  }
  for (v1::Step& step : *request.mutable_steps()) {
    for (v1::Tensor* t : {step.mutable_query(), step.mutable_key_padding_mask()})
      std::string().swap(*t->mutable_data());
  }
}

Status UndeliveredBy(SteadyClock::time_point deadline) {
  // A client's deadline arrives as a cancellation, possibly before the server's copy passes.
  if (CancelledByDeadline(deadline, SteadyClock::now())) {
    return Status(StatusCode::kDeadlineExceeded,
                  "the call's deadline passed before the answer was sent");
  }
  return Status(StatusCode::kCancelled, "the client cancelled or left before the answer was sent");
}

Answered::Answered(RequestPipeline* pipeline, const char* method, std::unique_ptr<Exchange> x,
                   Status status, SteadyClock::time_point deadline)
    : pipeline_(pipeline),
      method_(method),
      exchange_(std::move(x)),
      status_(std::move(status)),
      deadline_(deadline) {}

Answered::Answered(Answered&& other) noexcept
    : pipeline_(other.pipeline_),
      method_(other.method_),
      exchange_(std::move(other.exchange_)),
      status_(std::move(other.status_)),
      deadline_(other.deadline_) {}

Answered& Answered::operator=(Answered&& other) noexcept {
  if (this != &other) {
    if (exchange_) Deliver(UndeliveredBy(deadline_));
    pipeline_ = other.pipeline_;
    method_ = other.method_;
    exchange_ = std::move(other.exchange_);
    status_ = std::move(other.status_);
    deadline_ = other.deadline_;
  }
  return *this;
}

Answered::~Answered() {
  if (exchange_) Deliver(UndeliveredBy(deadline_));
}

void Answered::Deliver(const Status& seen) {
  if (!exchange_) return;
  pipeline_->Record(method_, exchange_.get(), seen);
  exchange_.reset();
}

HeldBytes Answered::Hand(const Status& seen) {
  if (!exchange_) return {};
  HeldBytes held(pipeline_, exchange_->held_bytes, exchange_->caller);
  exchange_->held_bytes = 0;  // Recorded without them: the token gives them back.
  pipeline_->Record(method_, exchange_.get(), seen);
  exchange_.reset();
  return held;
}

HeldBytes::HeldBytes(HeldBytes&& other) noexcept
    : pipeline_(other.pipeline_), bytes_(other.bytes_), caller_(std::move(other.caller_)) {
  other.bytes_ = 0;
}

HeldBytes& HeldBytes::operator=(HeldBytes&& other) noexcept {
  if (this != &other) {
    if (bytes_ > 0) pipeline_->Unreserve(bytes_, caller_);
    pipeline_ = other.pipeline_;
    bytes_ = other.bytes_;
    caller_ = std::move(other.caller_);
    other.bytes_ = 0;
  }
  return *this;
}

HeldBytes::~HeldBytes() {
  if (bytes_ > 0) pipeline_->Unreserve(bytes_, caller_);
}

}  // namespace attnserve
