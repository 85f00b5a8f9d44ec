// The batch queue's scheduling (tenants, weights, priority levels, queue policies, deadlines,
// cancellations, budgets) driven by operation sequences, with the invariants checked after each:
// every request comes back exactly once (taken, dropped or refused), the fair share counts exactly
// the requests queued, a batch holds one level and fits the budgets (or is one request), nothing is
// taken ahead of a higher level, and a Take with requests waiting and none dead takes some.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "server/pipeline/batcher.h"

namespace {

using namespace attnserve;

class NullModel : public AttentionModel {
 public:
  const ModelSpec& spec() const override { return spec_; }
  Status Forward(const AttendCall&, AttendOutputs*) const override { return Status::Ok(); }
  ModelSpec spec_;
};

// Aborts naming the invariant that failed.
#define Check(ok)                                                            \
  do {                                                                       \
    if (!(ok)) {                                                             \
      std::fprintf(stderr, "fuzz_scheduler: %s (line %d)\n", #ok, __LINE__); \
      std::abort();                                                          \
    }                                                                        \
  } while (0)

struct Reader {
  const uint8_t* p;
  size_t n;
  uint8_t Next() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  BatcherOptions options;
  options.max_batch_tokens = 1 + in.Next() % 64;
  options.max_shared_request_tokens = in.Next() % 64;
  options.max_batch_attention = 1 + in.Next() * 16;
  options.max_queue_size = 1 + in.Next() % 32;
  options.enabled = in.Next() % 4 != 0;
  options.scheduling =
      in.Next() % 2 ? BatcherOptions::Scheduling::kFair : BatcherOptions::Scheduling::kFcfs;
  PriorityOptions priorities;
  priorities.levels = in.Next() % 4;
  priorities.default_policy.max_queue_size = in.Next() % 8;
  priorities.default_policy.timeout_action =
      in.Next() % 2 ? TimeoutAction::kDelay : TimeoutAction::kReject;
  NullModel model;
  FairShare share;
  std::set<uint64_t> out;  // Ids handed back (taken, dropped, refused).
  uint64_t next_id = 0;
  auto now = SteadyClock::time_point(std::chrono::seconds(1000));
  {
    BatchQueue q(options, priorities, &share);
    std::set<std::string> tenants;
    const auto settle = [&](Dropped& dropped) {
      for (auto& [item, st] : dropped) {
        Check(out.insert(item->call.query_len).second);
        Check(!st.ok());
      }
      dropped.clear();
    };
    while (in.n > 0) {
      const uint8_t op = in.Next();
      now += std::chrono::microseconds(in.Next() * 50);
      Dropped dropped;
      if (op % 3 != 0) {  // Add.
        auto item = std::make_unique<WorkItem>();
        item->model = std::shared_ptr<const AttentionModel>(&model, [](const AttentionModel*) {});
        item->accepted = now;
        item->call.batch = 1;
        item->call.query_len = static_cast<int64_t>(next_id++);  // The id.
        item->call.tokens = 1 + in.Next() % 80;
        item->call.attention_cost = 1 + in.Next() * 8;
        item->tenant = std::string(1, static_cast<char>('a' + in.Next() % 4));
        item->weight = 1 + in.Next() % 4;
        item->flops = in.Next() * 1000.0;
        item->tenant_max_queued = in.Next() % 6;
        item->level = priorities.levels ? 1 + in.Next() % priorities.levels : 0;
        const uint8_t t = in.Next();
        if (t % 3 == 0) item->queue_timeout = now + std::chrono::microseconds(t * 40);
        item->timeout_action = priorities.default_policy.timeout_action;
        const uint8_t d = in.Next();
        if (d % 5 == 0) item->deadline = now + std::chrono::microseconds(d * 40);
        if (d % 7 == 1) item->cancelled = [] { return true; };
        tenants.insert(item->tenant);
        Status refused;
        const char* reason = "";
        auto back = q.Add(std::move(item), now, &dropped, &refused, &reason);
        Check((back == nullptr) == refused.ok());
        if (back) Check(out.insert(back->call.query_len).second);
      } else {  // Take.
        const size_t max = 1 + in.Next() % 8;
        const size_t before = q.size();
        auto batch = q.Take(now, &dropped, max);
        Check(batch.size() <= max);
        if (before > dropped.size()) Check(!batch.empty());  // Work-conserving.
        int64_t tokens = 0, cost = 0;
        for (const auto& item : batch) {
          Check(out.insert(item->call.query_len).second);
          Check(item->level == batch[0]->level);
          tokens += item->tokens();
          cost += item->attention_cost();
        }
        if (batch.size() > 1) {
          Check(tokens <= options.max_batch_tokens && cost <= options.max_batch_attention);
        }
        if (!batch.empty() && q.size() > 0) Check(!(q.rank().level < batch[0]->level));
      }
      settle(dropped);
      int64_t queued = 0;
      for (const auto& t : tenants) queued += share.Queued(t);
      Check(queued == static_cast<int64_t>(q.size()));
      Check(out.size() + q.size() == next_id);
    }
  }
  // The queue gone, the share holds nothing.
  for (char t = 'a'; t <= 'd'; ++t) Check(share.Queued(std::string(1, t)) == 0);
  return 0;
}
