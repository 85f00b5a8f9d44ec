#include "server/grpc/stream_reactor.h"

#include "server/core/caught.h"
#include "server/core/deadline.h"
#include "server/grpc/grpc_call.h"
#include "server/grpc/grpc_codec.h"
#include "server/grpc/grpc_status.h"

namespace attnserve {

StreamReactor::StreamReactor(RequestPipeline& pipeline, CallCounter& calls, StreamCodec& codec,
                             grpc::CallbackServerContext* ctx)
    : pipeline_(pipeline), calls_(calls), codec_(codec), ctx_(ctx) {
  calls_.Begin();
  pipeline_.AddCall(this);
  StatusOr<CallContext> call = CallOf(ctx, pipeline_);
  if (call.ok()) call_ = std::move(call).value();
  call_published_.store(true, std::memory_order_release);
  Actions a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!call.ok()) {  // Who is calling is not known: nothing of the stream is read.
      reads_closed_ = true;
      finish_status_ = call.status();
    } else if (pipeline_.draining()) {
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

Status StreamReactor::Undelivered() const { return UndeliveredBy(call_.deadline); }

void StreamReactor::Decide(Actions* a) {
  a->pipeline = &pipeline_;
  a->method = codec_.method();
  a->deadline = call_.deadline;
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
  // A request in a.next is still counted in computing_, so the call cannot finish before it is
  // dispatched: dispatching it last keeps every step above safe.
  RecordDropped(&a);
  if (a.read) StartRead(&read_buffer_);
  // Before the write or the finish: then the call may be gone.
  if (a.write || a.finish)
    calls_.sends().Handed(ctx_, a.write ? static_cast<int64_t>(a.write->Length()) : 0);
  if (a.write) StartWrite(a.write);
  if (a.finish) Finish(a.finish_status);
  if (a.next) Dispatch(std::move(*a.next));
}

void StreamReactor::RecordDropped(Actions* a) {
  a->dropped.clear();  // Each answered request's handle records it as not delivered.
  if (a->unsent.empty()) return;
  const Status undelivered = UndeliveredBy(a->deadline);
  for (size_t i = 0; i < a->unsent.size(); ++i) {
    a->pipeline->RecordUndecoded(a->method, undelivered);
  }
  a->unsent.clear();
}

void StreamReactor::Dispatch(Answer request) {
  const Status prepared =
      request.status.ok() ? codec_.Prepare(request.request.get()) : request.status;
  if (!prepared.ok()) {
    // Refused before the pipeline: counted now, answered like any failed request.
    pipeline_.RecordUndecoded(codec_.method(), prepared);
    request.status = prepared;
    OnComputed(std::move(request));
    return;
  }
  // computing_ holds the call open until OnComputed; `done` may run before Attend returns.
  std::unique_ptr<Exchange> x = std::move(request.request);
  auto* pending = new Answer(std::move(request));
  pipeline_.Attend(codec_.method(), std::move(x), call_, [this, pending](Answered answered) {
    std::unique_ptr<Answer> r(pending);
    r->status = answered.status();
    r->answered = std::move(answered);
    codec_.Computed(r->exchange(), r->status);
    OnComputed(std::move(*r));
  });
}

void StreamReactor::OnReadDone(bool ok) {
  Answer request;
  Status parsed;
  if (ok) {  // read_buffer_ belongs to the read chain until the next StartRead.
    call_published_.load(std::memory_order_acquire);  // call_ as the constructor left it.
    request.bytes = static_cast<int64_t>(read_buffer_.Length());
    parsed = Caught(codec_.method(), [&] {
      return codec_.Decode(read_buffer_, call_, &request.request, &request.status, &request.order);
    });
    read_buffer_.Clear();
  }
  Actions a;
  bool dispatch = false, undecodable = false;
  Status lost;  // Not OK for a request read when nobody can receive its answer.
  {
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    if (!ok) {
      reads_closed_ = true;  // The client half-closed (or the call ended).
    } else if (finished_ || gone_) {
      // Read after Finish or after the client left: nobody can receive an answer, but the request
      // arrived, so it is counted with the outcome its client sees.
      lost = gone_ || finish_status_.ok() ? Undelivered() : finish_status_;
    } else if (!parsed.ok()) {
      // Without a decodable message there is no request id to answer: end the stream, after the
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
      bytes_ += request.bytes;
      dispatch = true;
      if (!request.status.ok()) request.order.clear();  // Answered at once, in no order.
      if (!request.order.empty()) {
        // A later request of an order in compute waits for the ones before it.
        auto [it, first] = ordered_.try_emplace(request.order);
        if (!first) {
          it->second.push_back(std::move(request));
          dispatch = false;
        }
      }
    }
    Decide(&a);
  }
  if (undecodable) pipeline_.RecordUndecoded(codec_.method(), parsed);
  if (!lost.ok()) pipeline_.RecordUndecoded(codec_.method(), lost);
  Run(std::move(a));  // computing_ counts the request read, so the call is still open after Run.
  if (dispatch) Dispatch(std::move(request));
}

void StreamReactor::OnComputed(Answer request) {
  request.encoded = codec_.Encode(request.exchange(), request.status);
  const int64_t answer_bytes = static_cast<int64_t>(request.encoded.Length());
  // A refusal's answer is a few bytes: the request it refused is let go of now and recorded as
  // answered. Kept until its answer is written, it would hold its bytes outside every budget for
  // as long as the client does not read (a hostile review, 2026-12-05: AttendStreams whose
  // refusals a receive window of zero kept unwritten held +8.3 GiB).
  const bool refused = !request.status.ok();
  if (refused) {
    request.answered.Deliver(request.status);
    request.request.reset();
  } else if (Exchange* x = request.exchange()) {
    x->ReleaseInputs();  // Its answer, encoded, is all it holds while it waits to be written.
  }
  Actions a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --computing_;
    if (refused) {
      bytes_ -= request.bytes;  // Its request's bytes are gone; its answer's are counted below.
      request.bytes = 0;
    }
    if (!request.order.empty()) {
      auto it = ordered_.find(request.order);
      if (it != ordered_.end()) {
        if (it->second.empty()) {
          ordered_.erase(it);
        } else if (gone_) {
          // Nobody can receive their answers: the waiting requests are not dispatched.
          for (Answer& w : it->second) {
            --computing_;
            --requests_;
            bytes_ -= w.bytes;
            a.unsent.push_back(std::move(w));
          }
          ordered_.erase(it);
        } else {
          a.next = std::move(it->second.front());
          it->second.pop_front();
        }
      }
    }
    request.bytes += answer_bytes;
    bytes_ += answer_bytes;
    if (gone_) {
      --requests_;
      bytes_ -= request.bytes;
      a.dropped.push_back(std::move(request));
    } else {
      answers_.push_back(std::move(request));
    }
    Decide(&a);
  }
  const bool holds_call_open = a.read || a.write || a.finish || a.next;
  if (auto hook = computed_unlocked_for_test.load(std::memory_order_relaxed)) hook(holds_call_open);
  if (!holds_call_open) {
    // Nothing this thread does holds the call open: gRPC's threads may already have finished the
    // stream and deleted the reactor, so not even a member function of it is called (a static one
    // records what was dropped, with the pipeline and method copied under the lock).
    RecordDropped(&a);
    return;
  }
  Run(std::move(a));  // On a compute thread: after it, the reactor may be gone.
}

void StreamReactor::OnWriteDone(bool ok) {
  calls_.sends().Taken(ctx_);
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
  written.answered.Deliver(ok ? written.status : Undelivered());
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

void StreamReactor::FinishNow() {
  calls_.sends().Handed(ctx_, 0);
  Finish(drain_finish_);
}

void StreamReactor::OnDone() {
  calls_.sends().Taken(ctx_);
  pipeline_.RemoveCall(this);
  calls_.End(call_.IsCancelled());
  delete this;
}

}  // namespace attnserve
