// Session steps attending in kept runs: sessions' keys and values in a KvPool's chunks, the steps
// of a batch attending over them where they lie, one launch per chunk
// (EngineOptions::Varlen::kEmulate runs the CUDA engine's packing, pool and indexing on the CPU,
// with per-sequence attention in place of the kernel). Every answer must equal the same steps on
// the default CPU engine (per call, own blocks), whatever else the batch holds: forks, truncations,
// key padding, explicit positions, sessions spread over several chunks. Fresh random inputs from
// fixed seeds; tolerance: max |kept - per call| <= 1e-5 * max |per call| (MHA), 1e-4 (decoders:
// their rotation's float32 angles are computed for the run at once).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "server/core/validator.h"
#include "server/engine/attention_model.h"
#include "server/engine/torch_kv.h"
#include "tests/lib/decoder_reference.h"
#include "tests/lib/mha_reference.h"
#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

using testing::Buffer;

// The pool's own invariants over random allocations and releases: live slots never overlap, the
// rows counted used are the live slots' rows, a chunk with no slot is given back, and a slot
// larger than a chunk gets a chunk of its own.
TEST(KvPoolTest, SlotsNeverOverlapAndEmptyChunksAreGivenBack) {
  auto pool = std::make_shared<KvPool>(2, 4, at::TensorOptions().dtype(at::kFloat), 64);
  std::mt19937 rng(11);
  std::vector<std::unique_ptr<KvPool::Slot>> live;
  for (int op = 0; op < 4000; ++op) {
    if (live.empty() || rng() % 3 != 0) {
      const int64_t rows = rng() % 10 == 0 ? 65 + rng() % 100 : 1 + rng() % 40;
      live.push_back(pool->Allocate(rows));
      ASSERT_EQ(live.back()->rows(), rows);
      ASSERT_LE(live.back()->start() + rows, live.back()->chunk()->rows);
      ASSERT_EQ(live.back()->chunk()->k.size(0), live.back()->chunk()->rows);
    } else {
      live.erase(live.begin() + static_cast<int64_t>(rng() % live.size()));
    }
    std::map<const KvPool::Chunk*, std::vector<std::pair<int64_t, int64_t>>> by_chunk;
    int64_t used = 0;
    for (const auto& s : live) {
      by_chunk[s->chunk().get()].emplace_back(s->start(), s->rows());
      used += s->rows();
    }
    const KvPool::Usage u = pool->usage();
    ASSERT_EQ(u.used, used) << "op " << op;
    ASSERT_EQ(u.chunks, static_cast<int64_t>(by_chunk.size())) << "op " << op;
    for (auto& [chunk, slots] : by_chunk) {
      std::sort(slots.begin(), slots.end());
      for (size_t i = 1; i < slots.size(); ++i)
        ASSERT_LE(slots[i - 1].first + slots[i - 1].second, slots[i].first) << "op " << op;
      int64_t free_rows = 0;
      for (const auto& [start, rows] : chunk->free) free_rows += rows;
      ASSERT_EQ(free_rows + chunk->used, chunk->rows) << "op " << op;
    }
  }
  live.clear();
  EXPECT_EQ(pool->usage().chunks, 0);
  EXPECT_EQ(pool->usage().rows, 0);
  EXPECT_THROW(pool->Allocate(0), std::length_error);
  EXPECT_THROW(pool->Allocate(int64_t{1} << 31), std::length_error);
  EXPECT_EQ(pool->usage().chunks, 0);
}

// A bounded pool's chunks never hold more rows than its bound, however slots come and go: a new
// chunk is cut to what is left, and an allocation that fits no free run and no room is refused
// (null: the session's block then lies on its own).
TEST(KvPoolTest, ChunksNeverPassTheBound) {
  constexpr int64_t kMax = 300;
  auto pool = std::make_shared<KvPool>(1, 2, at::TensorOptions().dtype(at::kFloat), 64, kMax);
  std::mt19937 rng(12);
  std::vector<std::unique_ptr<KvPool::Slot>> live;
  int refused = 0;
  for (int op = 0; op < 4000; ++op) {
    if (live.empty() || rng() % 3 != 0) {
      const int64_t rows = 1 + static_cast<int64_t>(rng() % 70);
      std::unique_ptr<KvPool::Slot> slot = pool->Allocate(rows);
      if (!slot) {
        ++refused;
        // Refused only when no chunk has a free run that long and a new chunk has no room.
        ASSERT_LT(kMax - pool->usage().rows, rows) << "op " << op;
        for (const auto& s : live) {
          for (const auto& [start, run] : s->chunk()->free) ASSERT_LT(run, rows) << "op " << op;
        }
        continue;
      }
      live.push_back(std::move(slot));
    } else {
      live.erase(live.begin() + static_cast<int64_t>(rng() % live.size()));
    }
    ASSERT_LE(pool->usage().rows, kMax) << "op " << op;
  }
  EXPECT_GT(refused, 10);
  live.clear();
  EXPECT_EQ(pool->usage().rows, 0);
}

// With a pool too small for any session, every block lies on its own and every step attends alone,
// with the same answers.
TEST(KeptRunsBoundTest, SessionsPastThePoolsBoundAttendAlone) {
  std::mt19937 rng(707);
  const ModelWeights w = testing::RandomWeights(rng, "bound", 32, 4);
  EngineOptions small;
  small.varlen = EngineOptions::Varlen::kEmulate;
  small.kv_pool_max_bytes = 1;  // One row of keys and values.
  auto pooled = CreateTorchModel(w, small);
  auto plain = CreateTorchModel(w, EngineOptions{});
  ASSERT_TRUE(pooled.ok() && plain.ok());
  std::vector<std::shared_ptr<KvCache>> a, p;
  for (int s = 0; s < 3; ++s) {
    a.push_back((*plain)->NewKvCache());
    p.push_back((*pooled)->NewKvCache());
  }
  for (int64_t step = 0; step < 4; ++step) {
    const int64_t t = step == 0 ? 5 : 1, held = step == 0 ? 0 : 4 + step;
    std::vector<Buffer> bufs;
    bufs.reserve(3);
    std::vector<AttendCall> calls(3);
    std::vector<std::string> want(3), got(3);
    std::vector<AttendOutputs> wo(3), go(3);
    std::vector<const AttendCall*> together;
    std::vector<AttendOutputs*> outs;
    std::vector<AttendCall> pooled_calls(3);
    for (int s = 0; s < 3; ++s) {
      bufs.push_back(testing::Floats({1, t, 32}, testing::RandomFloats(rng, t * 32)));
      AttendCall& c = calls[s];
      c.query = bufs.back().view();
      c.is_causal = true;
      c.kv_use = AttendCall::Kv::kSession;
      c.kv_batch = 1;
      c.kv_length = held;
      c.kv_capacity = 16;
      ASSERT_TRUE(Validate((*plain)->spec(), {}, &c).ok());
      pooled_calls[s] = c;
      c.kv = a[s];
      pooled_calls[s].kv = p[s];
      wo[s].output = &want[s];
      ASSERT_TRUE((*plain)->Forward(c, &wo[s]).ok());
      go[s].output = &got[s];
      together.push_back(&pooled_calls[s]);
      outs.push_back(&go[s]);
    }
    const std::vector<Status> st = (*pooled)->ForwardBatch(together, outs);
    for (int s = 0; s < 3; ++s) {
      ASSERT_TRUE(st[s].ok()) << st[s].message();
      EXPECT_LE(testing::MaxAbsDiff(got[s], want[s]), 1e-5 * testing::MaxAbs(want[s]));
      EXPECT_STRNE(go[s].attention_backend, "kept_emulated") << "step " << step;
    }
  }
}

struct KeptCase {
  const char* name;
  bool decoder = false;
  testing::DecoderShape shape;
};

std::ostream& operator<<(std::ostream& os, const KeptCase& c) { return os << c.name; }

KeptCase Decoder(const char* name, int64_t window, bool qk_norm) {
  KeptCase c{name, true, {}};
  c.shape.name = name;
  c.shape.e = 64;
  c.shape.h = 8;
  c.shape.kvh = 2;
  c.shape.window = window;
  c.shape.qk_norm = qk_norm;
  return c;
}

// One session as both engines hold it.
struct Session {
  std::shared_ptr<KvCache> kept, alone;
  int64_t b = 1, held = 0, capacity = 0;
  bool seq_first = false, padded = false;
  // Its tokens lie in more than one block (TorchKv): a fork, and the session it was forked from
  // once it grows (the forked rows stay where they are, shared).
  bool pieces = false, forked = false;
};

class KeptRunsTest : public ::testing::TestWithParam<KeptCase> {};

TEST_P(KeptRunsTest, BatchedStepsEqualPerCallSteps) {
  const KeptCase& kc = GetParam();
  std::mt19937 rng(kc.decoder ? 606 : 505);
  const ModelWeights w = kc.decoder ? testing::RandomDecoderWeights(rng, kc.shape)
                                    : testing::RandomWeights(rng, "kept", 32, 4);
  const int64_t e = w.spec.embed_dim;
  auto alone_model = CreateTorchModel(w, EngineOptions{});
  EngineOptions kept_options;
  kept_options.varlen = EngineOptions::Varlen::kEmulate;
  kept_options.kv_pool_chunk_bytes = 8 << 10;  // A few sessions a chunk: runs over several chunks.
  auto kept_model = CreateTorchModel(w, kept_options);
  ASSERT_TRUE(alone_model.ok() && kept_model.ok());
  const ModelSpec spec = (*kept_model)->spec();
  const double tolerance = kc.decoder ? 1e-4 : 1e-5;

  std::vector<Session> sessions(7);
  for (size_t s = 0; s < sessions.size(); ++s) {
    sessions[s].b = s % 3 == 1 ? 2 : 1;
    sessions[s].seq_first = s == 4;  // [T, 2, E]: kept once its steps are one token
    if (s == 4) sessions[s].b = 2;
    sessions[s].kept = (*kept_model)->NewKvCache();
    sessions[s].alone = (*alone_model)->NewKvCache();
  }
  int kept_steps = 0;
  for (int round = 0; round < 12; ++round) {
    if (round == 4) {  // Session 6 becomes a fork of session 2's first tokens.
      Session& parent = sessions[2];
      Session& child = sessions[6];
      child.kept = (*kept_model)->NewKvCache();
      child.alone = (*alone_model)->NewKvCache();
      const int64_t length = parent.held - 1;
      ASSERT_TRUE(child.kept->ShareFrom(*parent.kept, length).ok());
      ASSERT_TRUE(child.alone->ShareFrom(*parent.alone, length).ok());
      child.b = parent.b;
      child.held = length;
      child.capacity = 0;
      child.pieces = true;
      parent.forked = true;
    }
    if (round == 6) sessions[0].held -= 3;  // Taken back: its next step overwrites 3 tokens.
    std::vector<Buffer> bufs;
    bufs.reserve(3 * sessions.size() + 1);
    std::vector<AttendCall> calls;
    std::vector<size_t> of;
    for (size_t s = 0; s < sessions.size(); ++s) {
      Session& ss = sessions[s];
      const int64_t t = round == 0 ? 3 + static_cast<int64_t>(s) : (round + s) % 5 == 0 ? 2 : 1;
      const std::vector<int64_t> shape =
          ss.seq_first ? std::vector<int64_t>{t, ss.b, e} : std::vector<int64_t>{ss.b, t, e};
      bufs.push_back(testing::Floats(shape, testing::RandomFloats(rng, ss.b * t * e)));
      AttendCall c;
      c.query = bufs.back().view();
      c.is_causal = true;
      c.layout = ss.seq_first ? TensorLayout::kSequenceFirst : TensorLayout::kBatchFirst;
      c.kv_use = AttendCall::Kv::kSession;
      c.kv_batch = ss.b;
      c.kv_length = ss.held;
      if (ss.held + t > ss.capacity) {
        ss.capacity = std::max<int64_t>({ss.held + t, 2 * ss.capacity, 16});
        ss.pieces = ss.pieces || ss.forked;
      }
      c.kv_capacity = ss.capacity;
      if (s == 3 && round == 5) {  // Key padding: this session attends per call from now on.
        bufs.push_back(testing::Zeros({ss.b, t}, DType::kBool));
        bufs.back().bytes[0] = 1;
        c.key_padding_mask = bufs.back().view();
        ss.padded = true;
      }
      if (kc.decoder && s == 5) {  // Explicit positions, past the session's length.
        if (round % 2 == 1) {
          for (int64_t j = 0; j < ss.b * t; ++j) c.positions.push_back(ss.held + 11 + 2 * j);
        } else {
          c.query_position = ss.held + 7;
        }
      }
      const Status valid = Validate(spec, {}, &c);
      ASSERT_TRUE(valid.ok()) << valid.message();
      calls.push_back(c);
      of.push_back(s);
      ss.held += t;
    }
    bufs.push_back(testing::Floats({1, 3, e}, testing::RandomFloats(rng, 3 * e)));
    AttendCall plain;
    plain.query = bufs.back().view();
    ASSERT_TRUE(Validate(spec, {}, &plain).ok());
    calls.push_back(plain);

    std::vector<std::string> a(calls.size()), k(calls.size());
    std::vector<AttendOutputs> ao(calls.size()), ko(calls.size());
    std::vector<const AttendCall*> together;
    std::vector<AttendOutputs*> outs;
    std::vector<AttendCall> kept_calls = calls;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (i < of.size()) {
        calls[i].kv = sessions[of[i]].alone;
        kept_calls[i].kv = sessions[of[i]].kept;
      }
      ao[i].output = &a[i];
      const Status st = (*alone_model)->Forward(calls[i], &ao[i]);
      ASSERT_TRUE(st.ok()) << st.message();
      ko[i].output = &k[i];
      together.push_back(&kept_calls[i]);
      outs.push_back(&ko[i]);
    }
    const std::vector<Status> st = (*kept_model)->ForwardBatch(together, outs);
    for (size_t i = 0; i < calls.size(); ++i) {
      ASSERT_TRUE(st[i].ok()) << st[i].message();
      const double err = testing::MaxAbsDiff(k[i], a[i]), scale = testing::MaxAbs(a[i]);
      EXPECT_GT(scale, 0.05);
      EXPECT_LE(err, tolerance * scale) << "round " << round << ", call " << i;
      if (i >= of.size()) continue;
      const Session& ss = sessions[of[i]];
      const bool kept = !ss.padded && !ss.pieces && (!ss.seq_first || kept_calls[i].query_len == 1);
      EXPECT_EQ(std::string(ko[i].attention_backend) == "kept_emulated", kept)
          << "round " << round << ", session " << of[i] << ": " << ko[i].attention_backend;
      kept_steps += kept;
    }
  }
  EXPECT_GT(kept_steps, 50);
}

INSTANTIATE_TEST_SUITE_P(Models, KeptRunsTest,
                         ::testing::Values(KeptCase{"Mha"}, Decoder("GroupedRotary", 0, false),
                                           Decoder("SlidingWindowQkNorm", 5, true)),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace attnserve
