#include "server/pipeline/batcher.h"

#include <malloc.h>

#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>

namespace attnserve {
namespace {

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

// The item lets go of its memory or session before `done` tells the client, so the client's next
// call finds it idle (evictable). The engine is done with it; the cache stays alive in `call.kv`.
void Complete(WorkItem& item, const Status& status) {
  item.kv_entry.reset();
  item.done(status, item);
}

bool Compatible(const WorkItem& a, const WorkItem& b) {
  return a.call.query.dtype == b.call.query.dtype && a.call.weights == b.call.weights;
}

}  // namespace

Status BatcherOptions::Validate() const {
  const auto fail = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  if (max_batch_tokens < 1) return fail("--max-batch-tokens must be >= 1");
  if (max_batch_attention < 1) return fail("--max-batch-attention must be >= 1");
  if (max_shared_request_tokens < 0) return fail("--max-shared-request-tokens must be >= 0");
  if (max_queue_delay.count() < 0) return fail("--max-queue-delay-us must be >= 0");
  if (max_queue_size < 1) return fail("--max-queue-size must be >= 1");
  if (workers < 1) return fail("--workers must be >= 1");
  return Status::Ok();
}

BatcherOptions BatcherOptions::ForDevice(const std::string& device, const Given& given) const {
  BatcherOptions o = *this;
  if (device.rfind("cuda", 0) != 0) return o;
  if (!given.max_batch_tokens) o.max_batch_tokens = kCudaBatchTokens;
  if (!given.max_shared_request_tokens) o.max_shared_request_tokens = o.max_batch_tokens;
  if (!given.max_batch_attention) o.max_batch_attention = kCudaBatchAttention;
  if (!given.workers) o.workers = kCudaWorkers;
  return o;
}

// ---- BatchQueue ---------------------------------------------------------------------------------

bool BatchQueue::Rank::operator<(const Rank& o) const {
  if (level != o.level) return level < o.level;
  if (delayed != o.delayed) return !delayed;
  if (counter != o.counter) return counter < o.counter;
  if (queued != o.queued) return queued < o.queued;
  return accepted < o.accepted;
}

BatchQueue::~BatchQueue() {
  for (const auto& item : items_) share_->Leave(item->tenant);
}

void BatchQueue::DropDead(SteadyClock::time_point now, Dropped* dropped) {
  std::deque<std::unique_ptr<WorkItem>> alive;
  for (auto& item : items_) {
    // The deadline first: a client's deadline arrives as a cancellation.
    const bool cancelled = item->cancelled && item->cancelled();
    const std::string waited = std::to_string(Seconds(now - item->accepted));
    Status dead;
    if (DeadlineEnded(item->deadline, now, cancelled)) {
      dead = Status(StatusCode::kDeadlineExceeded,
                    "deadline passed after " + waited + " s in the queue, before compute started");
    } else if (cancelled) {
      dead = Status(StatusCode::kCancelled, "cancelled by the client before compute");
    } else if (now >= item->queue_timeout && item->timeout_action == TimeoutAction::kReject) {
      const auto timeout = std::chrono::duration_cast<std::chrono::microseconds>(
          item->queue_timeout - item->accepted);
      dead = Status(StatusCode::kUnavailable,
                    "queue timeout: waited " + waited + " s at priority level " +
                        std::to_string(item->level) + ", past its timeout of " +
                        std::to_string(timeout.count()) +
                        " us (the level's queue policy, or the request's own timeout); retry "
                        "later or elsewhere");
    } else if (now >= item->queue_timeout) {
      item->delayed = true;  // DELAY: behind its level's requests that have not timed out.
    }
    if (dead.ok()) {
      alive.push_back(std::move(item));
    } else {
      share_->Leave(item->tenant);
      dropped->emplace_back(std::move(item), dead);
    }
  }
  items_.swap(alive);
}

bool BatchQueue::PushOut(const WorkItem& newcomer, Dropped* dropped) {
  std::unordered_map<std::string, int64_t> held;
  for (const auto& item : items_) ++held[item->tenant];
  const auto most = std::max_element(
      held.begin(), held.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  if (most == held.end() || most->second <= held[newcomer.tenant] + 1) return false;
  const std::string hog = most->first;
  for (auto it = items_.rbegin(); it != items_.rend(); ++it) {
    if ((*it)->tenant != hog || (*it)->warmup) continue;
    std::unique_ptr<WorkItem> newest = std::move(*it);
    items_.erase(std::next(it).base());
    share_->Leave(hog);
    dropped->emplace_back(
        std::move(newest),
        Status(StatusCode::kResourceExhausted,
               "queue full (server flag --max-queue-size " +
                   std::to_string(options_->max_queue_size) + "): caller '" + hog + "' held " +
                   std::to_string(held[hog]) +
                   " of its places, the most, and its newest request made room for another "
                   "caller's; retry later"));
    return true;
  }
  return false;
}

int64_t BatchQueue::QueuedAt(int64_t level) const {
  int64_t n = 0;
  for (const auto& item : items_) n += item->level == level ? 1 : 0;
  return n;
}

std::unique_ptr<WorkItem> BatchQueue::Add(std::unique_ptr<WorkItem> item,
                                          SteadyClock::time_point now, Dropped* dropped,
                                          Status* refused, const char** reason) {
  // The server's own warm-up is never refused: its few items wait beyond the bounds for a moment.
  if (!item->warmup) {
    const int64_t level_max = priorities_.PolicyOf(item->level).max_queue_size;
    const auto full = [&] {
      if (items_.size() >= options_->max_queue_size) {
        *reason = "queue_full";
        *refused = Status(StatusCode::kResourceExhausted,
                          "queue full: " + std::to_string(items_.size()) +
                              " requests waiting (server flag --max-queue-size); retry later");
      } else if (level_max > 0 && QueuedAt(item->level) >= level_max) {
        *reason = "priority_queue_full";
        *refused = Status(StatusCode::kResourceExhausted,
                          "queue of priority level " + std::to_string(item->level) +
                              " full: " + std::to_string(level_max) +
                              " requests waiting (its queue policy's max_queue_size); retry later");
      } else if (item->tenant_max_queued > 0 &&
                 share_->Queued(item->tenant) >= item->tenant_max_queued) {
        *reason = item->tenant_queue_cap ? "tenant_queue_full" : "caller_queue_full";
        *refused = Status(
            StatusCode::kResourceExhausted,
            (item->tenant_queue_cap ? "tenant '" : "caller '") + item->tenant + "' has " +
                std::to_string(share_->Queued(item->tenant)) + " requests waiting, " +
                (item->tenant_queue_cap ? "its max_queued_requests (--tenants)"
                                        : "the most one caller may (--max-queued-per-caller " +
                                              std::to_string(item->tenant_max_queued) + ")") +
                "; retry later");
      } else {
        *refused = Status();  // A place a dead request freed: accepted after all.
        return false;
      }
      return true;
    };
    if (full()) {
      DropDead(now, dropped);  // Frees their places.
      // The whole queue full: the caller that holds the most of it makes room.
      if (full() && !(std::string(*reason) == "queue_full" && PushOut(*item, dropped) && !full())) {
        return item;
      }
    }
  }
  share_->Arrive(item->tenant);
  items_.push_back(std::move(item));
  return nullptr;
}

bool BatchQueue::Shares(const WorkItem& item) const {
  return item.tokens() <= options_->max_shared_request_tokens;
}

size_t BatchQueue::Leader() const {
  const bool fair = options_->scheduling == BatcherOptions::Scheduling::kFair;
  size_t best = 0;
  Rank best_rank;
  for (size_t i = 0; i < items_.size(); ++i) {
    const WorkItem& item = *items_[i];
    // Among equal counters (a tenant back from idle is lifted to the smallest), the tenant with
    // fewer requests waiting; then arrival order, so a tenant is led by its oldest request.
    const Rank r{item.level, item.delayed, fair ? share_->Counter(item.tenant) : 0.0,
                 fair ? share_->Queued(item.tenant) : 0, SteadyClock::time_point()};
    if (i == 0 || r < best_rank) {
      best = i;
      best_rank = r;
    }
  }
  return best;
}

BatchQueue::Rank BatchQueue::rank() const {
  const WorkItem& lead = *items_[Leader()];
  const bool fair = options_->scheduling == BatcherOptions::Scheduling::kFair;
  return Rank{lead.level, lead.delayed, fair ? share_->Counter(lead.tenant) : 0.0,
              fair ? share_->Queued(lead.tenant) : 0, lead.accepted};
}

std::vector<size_t> BatchQueue::Fill(size_t leader, size_t max_requests) const {
  const WorkItem& lead = *items_[leader];
  std::vector<size_t> taken;
  if (!options_->enabled || !Shares(lead)) return taken;
  int64_t tokens = lead.tokens(), cost = lead.attention_cost();
  // Candidates: the leader's level and class, compatible, sharing; by tenant in arrival order.
  std::vector<std::string> tenants;
  std::map<std::string, std::deque<size_t>> by_tenant;
  for (size_t i = 0; i < items_.size(); ++i) {
    const WorkItem& item = *items_[i];
    if (i == leader || item.level != lead.level || item.delayed != lead.delayed ||
        !Compatible(lead, item) || !Shares(item)) {
      continue;
    }
    const bool fair = options_->scheduling == BatcherOptions::Scheduling::kFair;
    const std::string& key = fair ? item.tenant : lead.tenant;  // kFcfs: one line, by arrival.
    if (by_tenant[key].empty()) tenants.push_back(key);
    by_tenant[key].push_back(i);
  }
  std::map<std::string, double> counter;  // With what the batch gives each so far.
  for (const std::string& t : tenants) counter[t] = share_->Counter(t);
  counter[lead.tenant] += lead.flops / lead.weight;
  while (taken.size() + 1 < max_requests && !tenants.empty()) {
    // The tenant whose counter is smallest next; among equals the one with fewer waiting, then the
    // oldest request.
    auto next = std::min_element(tenants.begin(), tenants.end(), [&](const auto& a, const auto& b) {
      if (counter[a] != counter[b]) return counter[a] < counter[b];
      if (share_->Queued(a) != share_->Queued(b)) return share_->Queued(a) < share_->Queued(b);
      return by_tenant[a].front() < by_tenant[b].front();
    });
    std::deque<size_t>& line = by_tenant[*next];
    auto fit = std::find_if(line.begin(), line.end(), [&](size_t i) {
      return tokens + items_[i]->tokens() <= options_->max_batch_tokens &&
             cost + items_[i]->attention_cost() <= options_->max_batch_attention;
    });
    if (fit == line.end()) {
      tenants.erase(next);  // Nothing of this tenant fits any more.
      continue;
    }
    const WorkItem& item = *items_[*fit];
    tokens += item.tokens();
    cost += item.attention_cost();
    counter[*next] += item.flops / item.weight;
    taken.push_back(*fit);
    line.erase(fit);
    if (line.empty()) tenants.erase(next);
  }
  return taken;
}

bool BatchQueue::BudgetFull() const {
  const WorkItem& lead = *items_[Leader()];
  if (!Shares(lead)) return true;  // Alone, at once.
  int64_t tokens = 0, cost = 0;
  for (const auto& item : items_) {
    if (item->level != lead.level || item->delayed != lead.delayed || !Compatible(lead, *item) ||
        !Shares(*item)) {
      continue;
    }
    tokens += item->tokens();
    cost += item->attention_cost();
    if (tokens >= options_->max_batch_tokens || cost >= options_->max_batch_attention) return true;
  }
  return false;
}

bool BatchQueue::Ready(SteadyClock::time_point now, int busy_workers,
                       SteadyClock::time_point* wake) const {
  *wake = SteadyClock::time_point::max();
  if (items_.empty()) return false;
  if (!options_->enabled || busy_workers == 0 || BudgetFull()) return true;
  const auto due = items_.front()->accepted + options_->max_queue_delay;
  if (now >= due) return true;
  *wake = due;
  return false;
}

std::vector<std::unique_ptr<WorkItem>> BatchQueue::Take(SteadyClock::time_point now,
                                                        Dropped* dropped, size_t max_requests) {
  DropDead(now, dropped);
  std::vector<std::unique_ptr<WorkItem>> batch;
  if (items_.empty()) return batch;
  const size_t leader = Leader();
  std::vector<size_t> order = Fill(leader, max_requests);
  order.insert(order.begin(), leader);
  for (size_t i : order) {
    WorkItem& item = *items_[i];
    share_->Charge(item.tenant, item.flops, item.weight);
    share_->Leave(item.tenant);
    batch.push_back(std::move(items_[i]));
  }
  std::deque<std::unique_ptr<WorkItem>> rest;
  for (auto& item : items_) {
    if (item) rest.push_back(std::move(item));
  }
  items_.swap(rest);
  return batch;
}

// ---- Batcher ------------------------------------------------------------------------------------

Batcher::Batcher(BatcherOptions options)
    : options_(std::move(options)),
      idle_(options_.workers),
      pieces_([this] { return Width(); },
              [this] {
                // Under mu_: a worker between looking for work and waiting cannot miss it.
                std::lock_guard<std::mutex> lock(mu_);
                cv_.notify_all();
              }) {
  for (int i = 0; i < options_.workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

int Batcher::Width() const {
  return queued_.load(std::memory_order_relaxed) > 0 ? 1
                                                     : 1 + idle_.load(std::memory_order_relaxed);
}

void Batcher::Mirror() {
  size_t queued = 0;
  for (const auto& [model, queue] : queues_) queued += queue.size();
  queued_.store(queued, std::memory_order_relaxed);
  idle_.store(options_.workers - busy_, std::memory_order_relaxed);
}

Batcher::~Batcher() { Drain(); }

void Batcher::Finish(Dropped* dropped) {
  for (auto& [item, status] : *dropped) {
    if (options_.on_reject && !item->warmup) {
      const StatusCode code = status.code();
      options_.on_reject(*item, code == StatusCode::kDeadlineExceeded    ? "deadline"
                                : code == StatusCode::kUnavailable       ? "queue_timeout"
                                : code == StatusCode::kResourceExhausted ? "pushed_out"
                                                                         : "cancelled");
    }
    item->queue_seconds = Seconds(SteadyClock::now() - item->accepted);
    Complete(*item, status);
  }
  dropped->clear();
}

const PriorityOptions& Batcher::PrioritiesOf(const AttentionModel& model) const {
  const std::optional<PriorityOptions>& own = model.spec().priorities;
  return own ? *own : options_.priorities;
}

void Batcher::Submit(std::unique_ptr<WorkItem> item) {
  Dropped dropped;
  Status refused;
  const char* reason = "draining";
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) {
      refused =
          Status(StatusCode::kUnavailable, "server is shutting down; retry on another replica");
    } else {
      const AttentionModel* model = item->model.get();
      auto it = queues_.find(model);
      if (it == queues_.end()) {
        it = queues_
                 .emplace(std::piecewise_construct, std::forward_as_tuple(model),
                          std::forward_as_tuple(options_, PrioritiesOf(*model), &share_))
                 .first;
      }
      item = it->second.Add(std::move(item), SteadyClock::now(), &dropped, &refused, &reason);
      Mirror();
    }
  }
  Finish(&dropped);
  if (!refused.ok()) {
    if (options_.on_reject && !item->warmup) options_.on_reject(*item, reason);
    Complete(*item, refused);
    return;
  }
  cv_.notify_one();
}

std::vector<Status> Batcher::ComputeAndWait(const std::shared_ptr<const AttentionModel>& model,
                                            const std::vector<const AttendCall*>& calls,
                                            const std::vector<AttendOutputs*>& outs) {
  std::vector<Status> statuses(calls.size());
  std::mutex mu;
  std::condition_variable cv;
  size_t left = calls.size();
  for (size_t i = 0; i < calls.size(); ++i) {
    auto item = std::make_unique<WorkItem>();
    item->model = model;
    item->call = *calls[i];
    item->outputs = *outs[i];
    item->accepted = SteadyClock::now();
    item->warmup = true;
    item->done = [&, i, out = outs[i]](const Status& st, const WorkItem& w) {
      *out = w.outputs;  // What the engine set (backend, a staged answer).
      std::lock_guard<std::mutex> lock(mu);
      statuses[i] = st;
      if (--left == 0) cv.notify_all();
    };
    Submit(std::move(item));
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
  return statuses;
}

void Batcher::Drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

BatchQueue* Batcher::NextQueue(SteadyClock::time_point now, SteadyClock::time_point* wake,
                               bool* any, const AttentionModel** model_of_best) {
  BatchQueue* best = nullptr;
  std::optional<BatchQueue::Rank> best_rank;  // best's, once needed (a Rank scans its queue).
  for (auto& [model, queue] : queues_) {
    if (queue.size() == 0) continue;
    *any = true;
    SteadyClock::time_point w;
    // While draining nothing waits for company.
    if (!queue.Ready(now, busy_, &w) && !draining_) {
      *wake = std::min(*wake, w);
      continue;
    }
    if (best) {
      if (!best_rank) best_rank = best->rank();
      const BatchQueue::Rank rank = queue.rank();
      if (!(rank < *best_rank)) continue;
      best_rank = rank;
    }
    best = &queue;
    *model_of_best = model;
  }
  return best;
}

void Batcher::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const auto now = SteadyClock::now();
    auto wake = SteadyClock::time_point::max();
    const AttentionModel* best_model = nullptr;
    bool any = false;
    BatchQueue* best = NextQueue(now, &wake, &any, &best_model);
    if (best) {
      Dropped dropped;
      const size_t workers = static_cast<size_t>(options_.workers);
      auto batch = best->Take(now, &dropped, (best->size() + workers - 1) / workers);
      if (best->size() > 0) {
        cv_.notify_one();  // More may be ready for another worker.
      } else {
        // Keyed by the model's address: an empty queue goes, so that a model a reload unloaded
        // leaves nothing behind (its items, which hold it, are all taken).
        queues_.erase(best_model);
      }
      ++busy_;
      Mirror();
      idle_since_ = SteadyClock::time_point();
      lock.unlock();
      Finish(&dropped);
      if (!batch.empty()) Run(std::move(batch));
      lock.lock();
      --busy_;
      Mirror();
      trim_pending_ = true;
      continue;
    }
    if (draining_ && !any) return;
    // Nothing to take: run pieces of a batch another worker is splitting across the idle cores.
    // A helper stays idle for the width: counted busy, it was often still counted when the batch's
    // next operation asked, which then ran on fewer cores.
    if (pieces_.HasWork()) {
      lock.unlock();
      pieces_.Help();
      lock.lock();
      continue;
    }
    if (!any && busy_ == 0 && trim_pending_) {
      // Idle for a while after work: give the freed request, answer and engine buffers back to the
      // system. glibc keeps freed multi-MiB blocks in its arenas (its mmap threshold rises after
      // the first free), so RSS would otherwise stay at the last burst's peak. Only after
      // kTrimAfterIdle without work, so a lone caller's requests never pay for it (a fixed mmap
      // threshold did the same job at 25% of W2's throughput; trimming at every idle moment cost a
      // lone caller ~1.7 ms).
      if (idle_since_ == SteadyClock::time_point()) idle_since_ = now;
      if (now - idle_since_ >= kTrimAfterIdle) {
        trim_pending_ = false;
        idle_since_ = SteadyClock::time_point();
        lock.unlock();
        malloc_trim(0);
        lock.lock();
        continue;
      }
      wake = std::min(wake, idle_since_ + kTrimAfterIdle);
    }
    if (wake == SteadyClock::time_point::max()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, wake);
    }
  }
}

void Batcher::Run(std::vector<std::unique_ptr<WorkItem>> batch) {
  const auto start = SteadyClock::now();
  const int width = options_.tracer ? Width() : 0;
  std::vector<const AttendCall*> calls;
  std::vector<AttendOutputs*> outs;
  for (auto& item : batch) {
    item->queue_seconds = Seconds(start - item->accepted);
    item->batch_size = static_cast<int>(batch.size());
    if (item->entries.empty()) {
      calls.push_back(&item->call);
      outs.push_back(&item->outputs);
    }
    for (WorkItem::Entry& entry : item->entries) {  // A batched step: every entry a call.
      calls.push_back(&entry.call);
      outs.push_back(&entry.outputs);
    }
  }
  const AttentionModel* model = batch[0]->model.get();
  const std::vector<Status> computed =
      calls.empty() ? std::vector<Status>() : model->ForwardBatch(calls, outs, pieces_);
  std::vector<Status> statuses;  // One per item: a batched step's entries keep their own.
  for (size_t i = 0, c = 0; i < batch.size(); ++i) {
    if (batch[i]->entries.empty()) {
      statuses.push_back(computed[c++]);
      continue;
    }
    for (WorkItem::Entry& entry : batch[i]->entries) entry.status = computed[c++];
    statuses.push_back(Status::Ok());
  }
  // On a GPU the engine times the batch with CUDA events: kernel time, not the host's wait.
  const double device = outs.empty() ? -1 : outs[0]->device_seconds;
  const double compute = device >= 0 ? device : Seconds(SteadyClock::now() - start);
  const auto end = SteadyClock::now();
  std::vector<WorkItem*> raw;  // The clients' requests (a warm-up's are not counted).
  for (auto& item : batch) {
    item->compute_seconds = compute;
    item->started = start;
    item->finished = end;
    if (!item->warmup) raw.push_back(item.get());
  }
  if (options_.tracer) TraceBatch(batch, width);
  if (options_.on_batch && !raw.empty()) options_.on_batch(model->spec().name, raw, compute);
  for (size_t i = 0; i < batch.size(); ++i) Complete(*batch[i], statuses[i]);
}

void Batcher::TraceBatch(const std::vector<std::unique_ptr<WorkItem>>& batch, int width) const {
  const auto sampled = [](const auto& item) { return item->trace && item->trace->sampled; };
  if (std::none_of(batch.begin(), batch.end(), sampled)) return;
  const WorkItem& first = *batch.front();
  SpanData span = options_.tracer->Root("attnserve.batch", first.started, first.finished);
  int64_t tokens = 0;
  for (const auto& item : batch) {
    tokens += item->tokens();
    if (sampled(item)) span.links.push_back({item->trace->trace_id, item->trace->span_id});
  }
  span.Set("attnserve.model", first.model->spec().name);
  span.Set("attnserve.model_version", first.model->spec().version);
  span.Set("attnserve.batch.size", static_cast<int64_t>(batch.size()));
  span.Set("attnserve.batch.tokens", tokens);
  span.Set("attnserve.batch.width", static_cast<int64_t>(width));
  span.Set("attnserve.batch.compute_seconds", first.compute_seconds);
  for (const auto& item : batch) {
    item->batch_trace = span.trace_id;
    item->batch_span = span.span_id;
  }
  options_.tracer->Emit(std::move(span));
}

}  // namespace attnserve
