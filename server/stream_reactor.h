#pragma once

#include <grpcpp/grpcpp.h>

#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "server/request_pipeline.h"
#include "server/status.h"

namespace attnserve {

/// One AttendStream call: reads requests, dispatches each at once through the request pipeline, and
/// writes each answer as soon as it is computed (completion order; clients match answers by
/// request_id), one write at a time. A request that fails gets an answer carrying `error`; the
/// stream goes on. Created by the service per call; deletes itself in OnDone. Thread-safe: gRPC
/// reactions, compute completions and the pipeline's drain may run on different threads at once.
///
/// THE INVARIANT (everything below is kept under mu_):
///   The call is finished, exactly once, by whichever event makes Finishable() true:
///     - no more requests will be taken (reads closed: the client half-closed, a message did not
///       decode, the server is draining, or the call was cancelled or broken), and
///     - every dispatched request is back from compute (computing_ == 0), and
///     - no answer is being written or waits to be written (!writing_, answers_ empty; once the
///       client is gone the waiting answers are dropped instead of written).
///   That event's handler sets finished_ under mu_ and calls Finish after releasing it. No gRPC
///   operation (StartRead, StartWrite, Finish) is ever started while mu_ is held, because gRPC may
///   run a reaction inline, and no member is touched after the operation is started. Since compute
///   completions are counted in computing_, none can still reference the reactor when OnDone
///   (which gRPC runs after Finish and after every reaction) deletes it.
///   A read outstanding at Finish completes afterwards and is dropped.
///
/// Flow control: at most one read is outstanding, and a new one starts only while the stream holds
/// fewer than FlowLimits::max_stream_requests unanswered requests and fewer than max_stream_bytes
/// request plus answer bytes. Otherwise reading resumes when a write completes, so a client that
/// does not read its answers is held back by gRPC's flow control instead of growing the server.
///
/// Every dispatched request is recorded (RequestPipeline::Record) exactly once: when its answer has
/// been written, or when it is dropped because the client is gone (CANCELLED, or DEADLINE_EXCEEDED
/// once the stream's deadline passed).
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public OpenCall {
 public:
  StreamReactor(RequestPipeline& pipeline, grpc::CallbackServerContext* ctx);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  /// Called by the pipeline under its lock when the server begins to drain: closes reads. True when
  /// that makes the stream finishable; the caller then calls FinishNow after releasing its lock.
  bool Drain() override;
  /// Finishes the call with the status chosen when Drain returned true.
  void FinishNow() override;

 private:
  /// One request's answer on its way out.
  struct Answer {
    std::unique_ptr<Exchange> exchange;
    Status status;             // What the answer tells the client (OK, or the error it carries).
    grpc::ByteBuffer encoded;  // The answer's wire bytes.
    int64_t bytes = 0;         // Counted in bytes_ until written or dropped.
  };
  /// What an event decided under mu_, carried out after releasing it.
  struct Actions {
    bool read = false;
    grpc::ByteBuffer* write = nullptr;
    bool finish = false;
    grpc::Status finish_status;
    std::vector<Answer> dropped;  // Recorded as not delivered.
  };

  void OnComputed(Answer answer);
  // All below run with mu_ held.
  bool Finishable() const;
  bool CanRead() const;
  void Decide(Actions* a);
  void DropAnswers(Actions* a);
  // Without mu_.
  void Run(Actions a);
  Status Undelivered() const;

  RequestPipeline& pipeline_;
  const CallContext call_;        // The stream's deadline and cancellation, shared by its requests.
  grpc::ByteBuffer read_buffer_;  // Target of the one outstanding read.

  std::mutex mu_;
  bool reading_ = false;        // A read is outstanding.
  bool reads_closed_ = false;   // No new read will start.
  int computing_ = 0;           // Dispatched, not yet back from compute.
  std::deque<Answer> answers_;  // Computed; the front is being written while writing_.
  bool writing_ = false;
  bool gone_ = false;  // Cancelled, or a write failed: answers can no longer be delivered.
  bool finished_ = false;
  Status finish_status_;       // OK, INVALID_ARGUMENT (undecodable message), UNAVAILABLE (drain).
  int requests_ = 0;           // Unanswered requests (computing or waiting to be written).
  int64_t bytes_ = 0;          // Their request and answer bytes.
  uint64_t messages_ = 0;      // Messages read, for error messages.
  grpc::Status drain_finish_;  // Set by Drain when it decided to finish; used by FinishNow.
};

}  // namespace attnserve
