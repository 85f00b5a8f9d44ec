#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/grpc/call_counter.h"
#include "server/pipeline/request_pipeline.h"

namespace attnserve {

/// What one kind of stream reads and writes (AttendStream's attnserve.v1 messages, OIP's
/// ModelStreamInfer): the reactor's framing, ordering, flow control and drain are shared. One
/// codec serves every stream of its service, from many threads at once: it must be thread-safe.
class StreamCodec {
 public:
  virtual ~StreamCodec() = default;
  /// The method's name in metrics and messages.
  virtual const char* method() const = 0;
  /// One message read off the stream of `call` (its caller's tenant: whatever the message names,
  /// regions and sequences, is that tenant's). Non-OK: the bytes are not a message at all (or
  /// decoding threw); the stream ends with that status after answering the requests before it.
  /// Otherwise `*x` is the exchange and `*refused` non-OK when the request is answered at once
  /// with that error (the stream goes on). Requests with the same non-empty `*order` run one after
  /// another in the order they were read (a sequence's steps); the others run at once.
  virtual Status Decode(const grpc::ByteBuffer& bytes, const CallContext& call,
                        std::unique_ptr<Exchange>* x, Status* refused, std::string* order) = 0;
  /// Right before the request goes to the pipeline (after every earlier one of its order came
  /// back). Non-OK: it is answered with that error instead.
  virtual Status Prepare(Exchange*) { return Status::Ok(); }
  /// The outcome of a request that went to the pipeline, before it is encoded.
  virtual void Computed(Exchange*, const Status&) {}
  /// The answer's wire bytes: the computed answer (its buffers handed over) when `status` is OK,
  /// else an answer carrying that error.
  virtual grpc::ByteBuffer Encode(Exchange* x, const Status& status) = 0;
};

/// One streaming call: reads requests, dispatches each at once through the request pipeline (or
/// after the earlier requests of its order), and writes each answer as soon as it is computed
/// (completion order; clients match answers by their request ids), one write at a time. A request
/// that fails gets an answer carrying its error; the stream goes on. Created by the service per
/// call; deletes itself in OnDone. Thread-safe: gRPC reactions, compute completions and the
/// pipeline's drain may run on different threads at once.
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
///   run a reaction inline, and no member is touched after the operation is started. A reaction
///   cannot outlive the reactor (gRPC runs OnDone, which deletes it, after Finish and after every
///   reaction). A compute completion stops counting in computing_ under mu_; after that it touches
///   the reactor only through an action that holds the call open (a read, a write, the finish, the
///   next request of an order). Holding none, it lets go of what it dropped (each answer's handle
///   records itself) and counts what it never dispatched with the pipeline and method copied under
///   mu_, and calls nothing of the reactor: gRPC's threads may already have finished the stream
///   and deleted it.
///   A read outstanding at Finish completes afterwards and is dropped.
///
/// Flow control: at most one read is outstanding, and a new one starts only while the stream holds
/// fewer than FlowLimits::max_stream_requests unanswered requests and fewer than max_stream_bytes
/// request plus answer bytes. Otherwise reading resumes when a write completes, so a client that
/// does not read its answers is held back by gRPC's flow control instead of growing the server.
///
/// Every request read is recorded exactly once: one the pipeline answered by its handle
/// (Answered), when its answer has been written, or when it is dropped because the client is gone
/// (CANCELLED, or DEADLINE_EXCEEDED once the stream's deadline passed or is due: UndeliveredBy);
/// one the pipeline refused, when its (small) error answer is encoded, its request let go of then.
/// One refused before the pipeline (codec) is recorded when refused; one that waited for its order
/// when the client left is never dispatched and recorded then.
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public OpenCall {
 public:
  /// Borrows the pipeline, the count of calls open and the codec, which must outlive the call; the
  /// call is counted open until OnDone.
  StreamReactor(RequestPipeline& pipeline, CallCounter& calls, StreamCodec& codec,
                grpc::CallbackServerContext* ctx);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  /// Called by the pipeline under its lock when the server begins to drain: closes reads. True when
  /// that makes the stream finishable; the caller then calls FinishNow after releasing its lock.
  bool Drain() override;
  /// Finishes the call with the status chosen when Drain returned true.
  void FinishNow() override;

  /// Test seam (StreamSafetyTest): when set, runs on the compute thread right after OnComputed
  /// lets go of the lock, told whether this thread's actions hold the call open; a test widens the
  /// window in which gRPC's threads may finish and delete the reactor. Null in production.
  static inline std::atomic<void (*)(bool holds_call_open)> computed_unlocked_for_test{nullptr};

 private:
  /// One request's answer on its way out.
  struct Answer {
    // Read, until it goes to the pipeline (kept when refused before it).
    std::unique_ptr<Exchange> request;
    // Back from the pipeline: recorded when written, or when dropped (as not delivered).
    Answered answered;
    Status status;             // What the answer tells the client (OK, or the error it carries).
    grpc::ByteBuffer encoded;  // The answer's wire bytes.
    int64_t bytes = 0;         // Counted in bytes_ until written or dropped.
    std::string order;         // The codec's order key ("" when none).
    Exchange* exchange() const { return request ? request.get() : answered.get(); }
  };
  /// What an event decided under mu_, carried out after releasing it.
  struct Actions {
    bool read = false;
    grpc::ByteBuffer* write = nullptr;
    bool finish = false;
    grpc::Status finish_status;
    std::vector<Answer> dropped;  // Let go of: each records itself as not delivered.
    std::vector<Answer> unsent;   // Never dispatched; counted as not delivered.
    std::optional<Answer> next;   // The next request of an order, dispatched after Run.
    // Copied from the reactor under its lock: on a compute thread, once the lock is let go, the
    // reactor may be finished and deleted by gRPC's threads unless an action above holds it open,
    // so Run reads nothing of it for the recording.
    RequestPipeline* pipeline = nullptr;
    const char* method = nullptr;
    SteadyClock::time_point deadline = SteadyClock::time_point::max();
  };

  // Lets go of the answers dropped (recording them) and counts the requests never dispatched;
  // reads nothing of a reactor.
  static void RecordDropped(Actions* a);
  // Hands a request to the pipeline (or answers it with the codec's refusal).
  void Dispatch(Answer request);
  // A request's outcome (`request.status`): encodes and queues its answer.
  void OnComputed(Answer request);
  // All below run with mu_ held.
  bool Finishable() const;
  bool CanRead() const;
  void Decide(Actions* a);
  void DropAnswers(Actions* a);
  // Without mu_.
  void Run(Actions a);
  // Undelivered() for this stream's deadline.
  Status Undelivered() const;

  RequestPipeline& pipeline_;
  CallCounter& calls_;
  StreamCodec& codec_;
  grpc::CallbackServerContext* const ctx_;  // Valid until OnDone: its writes' send timeout.
  CallContext
      call_;  // Who calls, the deadline and cancellation, shared by its requests (set once).
  // Publishes call_ to the read callbacks, which read it before taking mu_. gRPC's completion
  // queue already orders the constructor before them, but ThreadSanitizer cannot see inside
  // Debian's uninstrumented gRPC and reported the decode's read against the constructor's write.
  std::atomic<bool> call_published_{false};
  grpc::ByteBuffer read_buffer_;  // Target of the one outstanding read.

  std::mutex mu_;
  bool reading_ = false;       // A read is outstanding.
  bool reads_closed_ = false;  // No new read will start.
  int computing_ = 0;          // Read, not yet back from compute (waiting for its order too).
  // Orders with a request in compute, each with the requests of that order read since (waiting).
  std::map<std::string, std::deque<Answer>> ordered_;
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
