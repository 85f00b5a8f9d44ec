#include "server/stream_reactor.h"

#include "server/grpc_call.h"
#include "server/grpc_codec.h"
#include "server/grpc_status.h"

namespace attnserve {

StreamReactor::StreamReactor(RequestPipeline& pipeline, grpc::CallbackServerContext* ctx)
    : pipeline_(pipeline), call_(CallOf(ctx)) {
  pipeline_.AddCall(this);
  Actions a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pipeline_.draining()) {
      reads_closed_ = true;
      finish_status_ =
          Status(StatusCode::kUnavailable, "server is shutting down; retry on another replica");
    }
    Decide(&a);
  }
  Run(std::move(a));
}

bool StreamReactor::Finishable() const {
  return !finished_ && reads_closed_ && computing_ == 0 && !writing_ && answers_.empty();
}

bool StreamReactor::CanRead() const {
  if (reads_closed_ || reading_ || finished_) return false;
  const FlowLimits& flow = pipeline_.flow();
  return requests_ == 0 || (requests_ < flow.max_stream_requests && bytes_ < flow.max_stream_bytes);
}

Status StreamReactor::Undelivered() const {
  if (SteadyClock::now() >= call_.deadline) {
    return Status(StatusCode::kDeadlineExceeded,
                  "the stream's deadline passed before the answer was sent");
  }
  return Status(StatusCode::kCancelled, "the client cancelled or left before the answer was sent");
}

void StreamReactor::Decide(Actions* a) {
  if (CanRead()) {
    reading_ = true;
    a->read = true;
  }
  if (!writing_ && !answers_.empty()) {
    writing_ = true;
    a->write = &answers_.front().encoded;
  }
  if (Finishable()) {
    finished_ = true;
    a->finish = true;
    a->finish_status = ToGrpcStatus(gone_ ? Undelivered() : finish_status_);
  }
}

void StreamReactor::DropAnswers(Actions* a) {
  // The front answer stays while it is being written: OnWriteDone accounts for it.
  const size_t keep = writing_ ? 1 : 0;
  while (answers_.size() > keep) {
    Answer& dropped = answers_.back();
    --requests_;
    bytes_ -= dropped.bytes;
    a->dropped.push_back(std::move(dropped));
    answers_.pop_back();
  }
}

void StreamReactor::Run(Actions a) {
  // The order matters: a started read is not part of Finishable(), so it goes first; after a
  // started write or Finish, another thread may finish and delete the reactor.
  RequestPipeline& pipeline = pipeline_;
  const Status undelivered = a.dropped.empty() ? Status() : Undelivered();
  for (Answer& d : a.dropped) pipeline.Record("AttendStream", d.exchange.get(), undelivered);
  if (a.read) StartRead(&read_buffer_);
  if (a.write) StartWrite(a.write);
  if (a.finish) Finish(a.finish_status);
}

void StreamReactor::OnReadDone(bool ok) {
  std::unique_ptr<Exchange> x;
  Status parsed;
  int64_t wire = 0;
  if (ok) {  // read_buffer_ belongs to the read chain until the next StartRead.
    x = std::make_unique<Exchange>();
    wire = static_cast<int64_t>(read_buffer_.Length());
    parsed = ParseRequest(read_buffer_, &x->request);
    read_buffer_.Clear();
  }
  Actions a;
  bool dispatch = false, undecodable = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    if (!ok) {
      reads_closed_ = true;  // The client half-closed (or the call ended).
    } else if (finished_ || gone_) {
      // Read after Finish or after the client left: nobody can receive an answer.
    } else if (!parsed.ok()) {
      // Without a decodable message there is no request_id to answer: end the stream, after the
      // requests before it are answered, with a status that says why.
      undecodable = true;
      reads_closed_ = true;
      finish_status_ = InvalidArgument("message " + std::to_string(messages_ + 1) +
                                       " on this stream: " + parsed.message() +
                                       "; the stream ends after answering the requests before it");
    } else {
      ++messages_;
      ++computing_;
      ++requests_;
      bytes_ += wire;
      dispatch = true;
    }
    if (!dispatch) Decide(&a);
  }
  if (undecodable) pipeline_.RecordUndecoded("AttendStream", parsed);
  if (dispatch) {
    // computing_ holds the call open until OnComputed; `done` may run before Dispatch returns.
    Exchange* raw = x.release();
    pipeline_.Attend("AttendStream", raw, call_, [this, raw, wire](const Status& st) {
      OnComputed(Answer{std::unique_ptr<Exchange>(raw), st, {}, wire});
    });
    std::lock_guard<std::mutex> lock(mu_);
    Decide(&a);
  }
  Run(std::move(a));
}

void StreamReactor::OnComputed(Answer answer) {
  if (answer.status.ok()) {
    answer.encoded = EncodeAnswer(&answer.exchange->answer);
  } else {
    v1::AttendResponse meta;
    meta.set_request_id(answer.exchange->request.request_id());
    meta.mutable_error()->set_code(static_cast<int>(ToGrpcCode(answer.status.code())));
    meta.mutable_error()->set_message(answer.status.message());
    answer.encoded = EncodeResponse(meta, nullptr, nullptr);
  }
  const int64_t answer_bytes = static_cast<int64_t>(answer.encoded.Length());
  Actions a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --computing_;
    answer.bytes += answer_bytes;
    bytes_ += answer_bytes;
    if (gone_) {
      --requests_;
      bytes_ -= answer.bytes;
      a.dropped.push_back(std::move(answer));
    } else {
      answers_.push_back(std::move(answer));
    }
    Decide(&a);
  }
  Run(std::move(a));  // On a compute thread: after it, the reactor may be gone.
}

void StreamReactor::OnWriteDone(bool ok) {
  Actions a;
  Answer written;
  {
    std::lock_guard<std::mutex> lock(mu_);
    written = std::move(answers_.front());
    answers_.pop_front();
    writing_ = false;
    --requests_;
    bytes_ -= written.bytes;
    if (!ok) {  // The client is gone: nothing more can be delivered.
      gone_ = true;
      reads_closed_ = true;
      DropAnswers(&a);
    }
    Decide(&a);
  }
  pipeline_.Record("AttendStream", written.exchange.get(), ok ? written.status : Undelivered());
  Run(std::move(a));
}

void StreamReactor::OnCancel() {
  Actions a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gone_ = true;
    reads_closed_ = true;
    DropAnswers(&a);
    Decide(&a);
  }
  Run(std::move(a));
}

bool StreamReactor::Drain() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!reads_closed_) {
    reads_closed_ = true;
    finish_status_ = Status(StatusCode::kUnavailable,
                            "server is shutting down: this stream takes no more requests (every "
                            "request answered before this status was processed); retry on another "
                            "replica");
  }
  Actions a;
  Decide(&a);  // Closed reads start nothing; with no work left this finishes.
  drain_finish_ = a.finish_status;
  return a.finish;
}

void StreamReactor::FinishNow() { Finish(drain_finish_); }

void StreamReactor::OnDone() {
  pipeline_.RemoveCall(this);
  delete this;
}

}  // namespace attnserve
