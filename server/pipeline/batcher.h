#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "server/core/deadline.h"
#include "server/core/scheduling.h"
#include "server/core/status.h"
#include "server/core/types.h"
#include "server/engine/attention_model.h"
#include "server/pipeline/fair_share.h"
#include "server/pipeline/host_cpus.h"
#include "server/trace/tracer.h"

namespace attnserve {

/// One accepted request on its way to the engine. Owns nothing on the wire: `call` and `outputs`
/// point into the RPC's request and response, which live until `done` has run.
struct WorkItem {
  /// Held until the item is destroyed: a model that a reload replaced or removed finishes what it
  /// accepted and unloads after its last item.
  std::shared_ptr<const AttentionModel> model;
  /// The memory or session the call uses (a KvEntry), held the same way while the item waits and
  /// computes: an evicted or closed one stays allocated, and counted, until its last request is
  /// computed. Let go of before `done` runs, so the client told finds it idle.
  std::shared_ptr<const void> kv_entry;
  AttendCall call;
  AttendOutputs outputs;
  /// A batched step's entries (AttendRequest.steps), each its own call and outputs: computed in
  /// the batch this item joins, never split from each other, one status each (the item's own
  /// status then says whether the batch ran at all). `call` then carries only what the queue
  /// reads: the entries' query dtype, no weights, their tokens and attention cost summed.
  struct Entry {
    AttendCall call;
    AttendOutputs outputs;
    Status status;
  };
  std::vector<Entry> entries;
  SteadyClock::time_point accepted;
  SteadyClock::time_point deadline = SteadyClock::time_point::max();
  /// Polled while queued; true drops the item with CANCELLED.
  std::function<bool()> cancelled;
  /// Runs exactly once, on a worker thread (or the submitter's when refused), with the outcome;
  /// whatever it captures of the memory or session it lets go of before telling the client.
  std::function<void(const Status&, const WorkItem&)> done;

  /// The request's trace (owned by the call, which outlives the item); null: none.
  const CallTrace* trace = nullptr;
  /// A model's warm-up, not a client's request: computed as one, left out of the batch metrics
  /// and traces.
  bool warmup = false;

  // Who asks and how urgently (docs/tenants.md), set by the pipeline.
  /// Whose fair share it draws on: its caller (RequestPipeline's CallerOf: the tenant, or a
  /// caller that names none told apart by its peer address).
  std::string tenant = "default";
  std::string tenant_label = "default";  ///< Its metrics label (Tenants::Label).
  double weight = 1;                     ///< The tenant's weight (> 0).
  /// Its caller's most requests queued at once: the tenant's `max_queued_requests` (when
  /// `tenant_queue_cap`), else --max-queued-per-caller; 0: no bound.
  int64_t tenant_max_queued = 0;
  bool tenant_queue_cap = false;
  int64_t level = 0;  ///< Priority level: 1 first; 0 when the model has no levels.
  double flops = 0;   ///< What computing it costs (ForwardFlops): the fair share's unit.
  /// When its level's queue timeout ends its wait (max: none), and what that does.
  SteadyClock::time_point queue_timeout = SteadyClock::time_point::max();
  TimeoutAction timeout_action = TimeoutAction::kReject;
  bool delayed = false;  ///< Timed out with DELAY: behind its level's other requests.

  // Filled on completion.
  double queue_seconds = 0;
  double compute_seconds = 0;
  int batch_size = 0;
  SteadyClock::time_point started, finished;  ///< The batch's compute, on the host's clock.
  /// The batch's span, when it was traced (some request of it sampled); zero otherwise.
  TraceId batch_trace{};
  SpanId batch_span{};

  /// The validated call's AttendCall::tokens and attention_cost.
  int64_t tokens() const { return call.tokens; }
  int64_t attention_cost() const { return call.attention_cost; }
};

/// Items dropped before compute, each with the reason (DEADLINE_EXCEEDED or CANCELLED).
using Dropped = std::vector<std::pair<std::unique_ptr<WorkItem>, Status>>;

/// How batches are formed. Defaults suit a CPU (measured on the 2-core machines,
/// bench/RESULTS.md); ForDevice gives a CUDA device its own.
struct BatcherOptions {
  /// Most tokens (WorkItem::tokens) in one batch. A single larger request still runs, alone. Past
  /// ~1k tokens the engine's GEMMs are efficient anyway, and smaller batches keep every worker
  /// busy.
  int64_t max_batch_tokens = 1024;
  /// Requests with more tokens than this are computed alone and never wait for company: they fill
  /// the engine's GEMMs by themselves, and sharing a batch would only hold their answers back.
  int64_t max_shared_request_tokens = 256;
  /// Most Σ batch·Lq·Lk in one batch (bounds the attention part).
  int64_t max_batch_attention = int64_t{1} << 22;
  /// How long the oldest request may wait for company before its batch closes anyway.
  std::chrono::microseconds max_queue_delay{500};
  /// Accepted, not yet started requests per model; beyond: RESOURCE_EXHAUSTED.
  size_t max_queue_size = 1024;
  /// The most of them one caller (a tenant, or a peer address: WorkItem::tenant) may have waiting,
  /// unless its tenant has a max_queued_requests of its own; beyond: RESOURCE_EXHAUSTED. 0: no
  /// bound of its own (server flag --max-queued-per-caller). Whatever it is, when the queue is full
  /// a caller's request makes room by refusing the newest request of the caller that holds the
  /// most of the queue (more than its own caller would): one caller may fill an idle queue, and
  /// none can keep another out.
  size_t max_queued_per_caller = 0;
  /// false: every request is its own batch and none waits for company.
  bool enabled = true;
  /// Compute threads, shared by all models: one per usable core (host_cpus.h's UsableCpus: CPU
  /// affinity, capped by a cgroup CPU quota), as the server flag --workers defaults to.
  int workers = UsableCpus();
  /// Called once per computed batch (for metrics), on the worker thread.
  std::function<void(const std::string& model, const std::vector<WorkItem*>& batch,
                     double compute_seconds)>
      on_batch;
  /// Traces batches that carry a sampled request (a span of their own, linked to each such
  /// request's span); null: none. Borrowed.
  const Tracer* tracer = nullptr;
  /// Called for each request refused or dropped before compute: reason is "queue_full",
  /// "priority_queue_full", "tenant_queue_full", "caller_queue_full", "pushed_out" (refused to
  /// make room for another caller's), "queue_timeout", "draining", "deadline" or "cancelled".
  std::function<void(const WorkItem& item, const char* reason)> on_reject;
  /// Whose request leads the next batch: kFair, the backlogged tenant with the least weighted
  /// work served (FairShare), its batch filled in the same order; kFcfs, the oldest request
  /// (--scheduling). Priority levels come first either way.
  enum class Scheduling { kFair, kFcfs } scheduling = Scheduling::kFair;
  /// Priority levels and their queues for models whose config.json sets none (--priority-levels,
  /// --default-priority-level, --queue-policy).
  PriorityOptions priorities;

  /// Checks the options: FAILED_PRECONDITION naming the flag at fault.
  Status Validate() const;

  /// Which of the budgets were set by the operator (server flags); ForDevice keeps those.
  struct Given {
    bool max_batch_tokens = false, max_shared_request_tokens = false, max_batch_attention = false,
         workers = false;
  };
  /// On a CUDA device ("cuda", "cuda:N"), the budgets not `given` become the GPU's: batches of
  /// kCudaBatchTokens tokens that every request up to that size shares (one packed GEMM per
  /// projection and varlen attention over long requests too), an attention budget that never
  /// binds before the token budget does, and kCudaWorkers host threads feeding the device.
  /// Elsewhere nothing changes. docs/hardware.md "GPU defaults" gives the reasoning and the
  /// measurement that checks them.
  BatcherOptions ForDevice(const std::string& device, const Given& given) const;
  static constexpr int64_t kCudaBatchTokens = 16384;
  static constexpr int64_t kCudaBatchAttention = int64_t{1} << 32;
  static constexpr int kCudaWorkers = 4;
};

/// The batch-forming rules for one model's queue, without threads or clocks of its own: every
/// method takes `now`, so tests drive it deterministically. Not thread-safe.
///
/// Rules: a batch is led by a request of the first priority level that has any (requests timed
/// out with DELAY after the others of their level); within the level, by the oldest request of
/// the backlogged tenant with the smallest FairShare counter (kFair; among equal counters, the one
/// with fewer requests waiting: a tenant back from idle is lifted to a tie) or by the oldest
/// request (kFcfs). It then takes each request of that level that is compatible with its leader
/// (same wire dtype and attention-weights mode) while the token and attention budgets hold, tenant
/// by tenant in the same order (the one whose counter, with what the batch already gives it, is
/// smallest next; kFcfs: arrival order); the rest wait for a later batch. Each request taken is
/// charged its FLOPs over its tenant's weight. A batch is ready when the compatible requests fill
/// the budget, when the oldest has waited max_queue_delay, or at once when no worker is
/// computing (waiting for company only pays off under load). Requests over
/// max_shared_request_tokens always form a batch of their own, at once. A worker takes at most
/// its share of the queue, ⌈queued / workers⌉ requests, so that below saturation requests spread
/// over the cores instead of queueing behind each other in one batch. Expired, cancelled and
/// timed-out requests are dropped when a batch is taken and whenever the queue is full.
class BatchQueue {
 public:
  /// `share` counts every queue's tenants (the batcher's one); borrowed.
  BatchQueue(const BatcherOptions& options, PriorityOptions priorities, FairShare* share)
      : options_(&options), priorities_(std::move(priorities)), share_(share) {}
  ~BatchQueue();  ///< Tells the share that what it still holds left.
  BatchQueue(const BatchQueue&) = delete;
  BatchQueue& operator=(const BatchQueue&) = delete;

  /// Adds an item. When a bound refuses it (--max-queue-size, its level's max_queue_size, its
  /// tenant's max_queued_requests, after dropping dead items), returns it with `*refused` saying
  /// why (RESOURCE_EXHAUSTED) and `*reason` the metrics label. A warm-up's item is never refused.
  std::unique_ptr<WorkItem> Add(std::unique_ptr<WorkItem> item, SteadyClock::time_point now,
                                Dropped* dropped, Status* refused, const char** reason);
  /// True when a batch should be taken now; otherwise `*wake` is when one will be (max if empty).
  /// `busy_workers`: how many workers are computing right now.
  bool Ready(SteadyClock::time_point now, int busy_workers, SteadyClock::time_point* wake) const;
  /// Takes the next batch (empty when nothing is queued), of at most `max_requests` requests.
  /// Dead items go to `dropped`.
  std::vector<std::unique_ptr<WorkItem>> Take(SteadyClock::time_point now, Dropped* dropped,
                                              size_t max_requests = SIZE_MAX);
  size_t size() const { return items_.size(); }
  /// The oldest item's acceptance time (queue must not be empty).
  SteadyClock::time_point oldest() const { return items_.front()->accepted; }
  const PriorityOptions& priorities() const { return priorities_; }

  /// Which of several queues a worker serves first (lower first): their leaders' level, then
  /// DELAY'd after not, then (kFair) the leader's tenant's counter and its requests waiting, then
  /// its age.
  struct Rank {
    int64_t level = 0;
    bool delayed = false;
    double counter = 0;
    int64_t queued = 0;
    SteadyClock::time_point accepted;
    bool operator<(const Rank& o) const;
  };
  Rank rank() const;  ///< Queue must not be empty.

 private:
  void DropDead(SteadyClock::time_point now, Dropped* dropped);
  // The queue is full and `newcomer` arrives: the caller holding the most of it (more than the
  // newcomer's caller's after it joins) gives up its newest request, refused into `dropped`. False
  // when no caller holds more.
  bool PushOut(const WorkItem& newcomer, Dropped* dropped);
  bool BudgetFull() const;
  bool Shares(const WorkItem& item) const;
  size_t Leader() const;  // Index of the item that leads the next batch (queue not empty).
  // The requests that join the leader's batch, in the order they are taken (indices).
  std::vector<size_t> Fill(size_t leader, size_t max_requests) const;
  int64_t QueuedAt(int64_t level) const;

  const BatcherOptions* options_;
  const PriorityOptions priorities_;
  FairShare* share_;
  std::deque<std::unique_ptr<WorkItem>> items_;
};

/// Per-model BatchQueues served by a pool of compute threads. Thread-safe.
///
/// A batch's compute may be split across the workers that are idle when it runs (Parallel, passed
/// to ForwardBatch): a worker with nothing to take helps whichever batch offers pieces. While any
/// request waits in a queue the width is 1: under load every core computes whole batches.
class Batcher {
 public:
  explicit Batcher(BatcherOptions options);
  ~Batcher();  ///< Drains.
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  /// Takes the item. When it is refused (queue full: RESOURCE_EXHAUSTED; draining: UNAVAILABLE)
  /// its `done` runs before Submit returns.
  void Submit(std::unique_ptr<WorkItem> item);

  /// Computes `calls` of `model` as requests are computed (queued, batched with whatever else
  /// waits, on the workers and their idle helpers) and waits for them: a model's warm-up, whose
  /// kernels, primitives and per-thread buffers are then made on the threads that will serve it.
  /// Not counted in the batch metrics. One Status per call (UNAVAILABLE once draining).
  std::vector<Status> ComputeAndWait(const std::shared_ptr<const AttentionModel>& model,
                                     const std::vector<const AttendCall*>& calls,
                                     const std::vector<AttendOutputs*>& outs);

  /// Stops accepting, computes everything queued, joins the workers. Idempotent.
  void Drain();

  /// The priority levels `model`'s requests are queued by: its config.json's, else the server's.
  const PriorityOptions& PrioritiesOf(const AttentionModel& model) const;
  const BatcherOptions& options() const { return options_; }

 private:
  void WorkerLoop();
  // Under mu_: the queue a worker takes from now (the ready one whose leader ranks first), or null;
  // lowers `*wake` to when a waiting queue will be ready, sets `*any` when some queue holds
  // requests.
  BatchQueue* NextQueue(SteadyClock::time_point now, SteadyClock::time_point* wake, bool* any,
                        const AttentionModel** model_of_best);
  void Finish(Dropped* dropped);
  void Run(std::vector<std::unique_ptr<WorkItem>> batch);
  // The batch's span, when a request in it is sampled: stamps the items with its ids.
  void TraceBatch(const std::vector<std::unique_ptr<WorkItem>>& batch, int width) const;
  // Threads that may run a batch's pieces now: 1 while any request waits, else 1 + idle workers.
  int Width() const;
  // Under mu_: updates idle_ and queued_ after busy_ or a queue changed.
  void Mirror();

  const BatcherOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  FairShare share_;  // Every queue's tenants.
  std::map<const AttentionModel*, BatchQueue> queues_;
  bool draining_ = false;
  int busy_ = 0;  // Workers computing a batch, or pieces of one.
  // Mirrors for Width(), read without mu_: workers not busy, requests queued.
  std::atomic<int> idle_{0};
  std::atomic<size_t> queued_{0};
  PieceExchange pieces_;
  bool trim_pending_ = false;           // Work ran since the last malloc_trim.
  SteadyClock::time_point idle_since_;  // When the last worker went idle (zero: not idle).
  static constexpr std::chrono::seconds kTrimAfterIdle{1};
  std::vector<std::thread> workers_;
};

}  // namespace attnserve
