#include "server/engine/torch_kv.h"

#include <sys/mman.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "server/core/checked_math.h"

namespace attnserve {

at::Tensor KeptEmpty(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  if (!opts.device().is_cpu()) return at::empty(sizes, opts);
  std::optional<int64_t> n = static_cast<int64_t>(c10::elementSize(opts.dtype().toScalarType()));
  for (int64_t s : sizes) n = n ? CheckedMul({*n, s}) : n;
  if (!n || *n < 0) return at::empty(sizes, opts);  // Refused there, with LibTorch's message.
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(*n));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) return at::empty(sizes, opts);  // Let the heap try (and fail as it does).
  return at::from_blob(
      p, sizes, [bytes](void* q) { munmap(q, bytes); }, opts);
}

KvPool::KvPool(int64_t heads, int64_t head_dim, const at::TensorOptions& opts, int64_t chunk_rows,
               int64_t max_rows)
    : heads_(heads),
      head_dim_(head_dim),
      chunk_rows_(std::max<int64_t>(1, chunk_rows)),
      max_rows_(std::max<int64_t>(0, max_rows)),
      opts_(opts) {}

std::unique_ptr<KvPool::Slot> KvPool::Allocate(int64_t rows) {
  if (rows <= 0 || rows > std::numeric_limits<int32_t>::max())
    throw std::length_error("kept keys and values: a pool slot of " + std::to_string(rows) +
                            " rows (at most 2^31 - 1)");
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::shared_ptr<Chunk>& c : chunks_) {
    for (auto it = c->free.begin(); it != c->free.end(); ++it) {
      if (it->second < rows) continue;
      const int64_t start = it->first, left = it->second - rows;
      c->free.erase(it);
      if (left > 0) c->free.emplace(start + rows, left);
      c->used += rows;
      return std::make_unique<Slot>(shared_from_this(), c, start, rows);
    }
  }
  int64_t held = 0;
  for (const std::shared_ptr<Chunk>& c : chunks_) held += c->rows;
  int64_t want =
      std::min<int64_t>(std::max(rows, chunk_rows_), std::numeric_limits<int32_t>::max());
  if (max_rows_ > 0) {  // A smaller chunk where a default one would pass the bound; none past it.
    want = std::min(want, max_rows_ - held);
    if (want < rows) return nullptr;
  }
  auto c = std::make_shared<Chunk>();
  c->rows = want;
  c->k = at::empty({c->rows, heads_, head_dim_}, opts_);  // May throw: nothing changed yet.
  c->v = at::empty({c->rows, heads_, head_dim_}, opts_);
  if (c->rows > rows) c->free.emplace(rows, c->rows - rows);
  c->used = rows;
  chunks_.push_back(c);
  return std::make_unique<Slot>(shared_from_this(), c, 0, rows);
}

void KvPool::Release(Chunk& chunk, int64_t start, int64_t rows) {
  std::lock_guard<std::mutex> lock(mu_);
  chunk.used -= rows;
  if (chunk.used == 0) {  // Given back whole (the slots' own references go with them).
    chunks_.erase(
        std::remove_if(chunks_.begin(), chunks_.end(),
                       [&](const std::shared_ptr<Chunk>& c) { return c.get() == &chunk; }),
        chunks_.end());
    chunk.free.clear();
    return;
  }
  auto next = chunk.free.lower_bound(start);
  if (next != chunk.free.end() && next->first == start + rows) {  // Joins the run after it.
    rows += next->second;
    next = chunk.free.erase(next);
  }
  if (next != chunk.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {  // And the one before.
      prev->second += rows;
      return;
    }
  }
  chunk.free.emplace(start, rows);
}

KvPool::Usage KvPool::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  Usage u;
  for (const std::shared_ptr<Chunk>& c : chunks_) {
    ++u.chunks;
    u.rows += c->rows;
    u.used += c->used;
  }
  return u;
}

KvBlock::~KvBlock() {
  if (ledger) ledger->Charge(-bytes);
}

TorchKv::~TorchKv() { ReleaseOwn(); }

std::optional<int64_t> TorchKv::BytesFor(int64_t batch, int64_t capacity) const {
  if (batch < 0 || capacity < 0) return std::nullopt;
  return CheckedMul({batch, capacity, 2 * embed_dim_ + 1, elem_});  // keys, values, key padding
}

int64_t TorchKv::AllocatedTokens() const {
  if (mk_.defined()) return mk_.size(2);  // A memory.
  return own_ || base_ > 0 ? base_ + OwnRows() : 0;
}

std::vector<TorchKv::Shared> TorchKv::SharedUpTo(int64_t tokens) const {
  std::vector<Shared> kept;
  int64_t off = 0;
  for (const Shared& s : shared_) {
    if (off >= tokens) break;
    const int64_t rows = std::min(s.rows, tokens - off);
    kept.push_back(Shared{s.block, rows});
    off += rows;
  }
  return kept;
}

void TorchKv::ReleaseOwn() {
  // Forks may still read it: from now on it counts itself, until its last reader lets go (then
  // ~KvBlock gives the bytes back; at once when none is left).
  if (own_ && frozen_ > 0 && ledger_ && !own_->ledger) {
    own_->ledger = ledger_;
    ledger_->Charge(own_->bytes);
  }
  own_.reset();
  frozen_ = 0;
}

std::shared_ptr<KvBlock> TorchKv::NewBlock(int64_t b, int64_t h, int64_t rows, int64_t d,
                                           const at::TensorOptions& opts, bool padding) const {
  auto block = std::make_shared<KvBlock>();
  // In the pool where its rows fit the kernels' int32 row offsets (an allocation past them, of a
  // model with few, narrow heads under a budget of tens of GiB, stays out) and the pool's bound:
  // otherwise on its own, its steps attending alone.
  if (pool_ && pool_->heads() == h && pool_->head_dim() == d && b * rows > 0 &&
      b * rows <= std::numeric_limits<int32_t>::max() && pool_->options().dtype() == opts.dtype() &&
      pool_->options().device() == opts.device()) {
    block->slot = pool_->Allocate(b * rows);
  }
  if (block->slot) {
    const auto view = [&](const at::Tensor& all) {
      return all.narrow(0, block->slot->start(), b * rows)
          .view({b, rows, h, d})
          .permute({0, 2, 1, 3});
    };
    block->k = view(block->slot->chunk()->k);
    block->v = view(block->slot->chunk()->v);
  } else {
    block->k = KeptEmpty({b, h, rows, d}, opts);
    block->v = KeptEmpty({b, h, rows, d}, opts);
  }
  if (padding) block->kpm = KeptEmpty({b, rows}, opts).zero_();
  block->bytes = BytesFor(b, rows).value_or(0);
  return block;
}

// How a step after `held` tokens treats what the session holds (PlanAppend tells the store,
// Append does it):
//   trim     it was taken back into its shared tokens: keep the shared blocks up to `held`, and
//            start a new own block;
//   freeze   it would overwrite rows of its own block that forks read: those rows up to `held`
//            become a shared block of its own, and a new own block starts after them;
//   compact  more than kMaxShared shared blocks would remain: the whole history is copied into
//            one new own block;
//   in place the own block takes the step (grown first when full: copied when private, frozen as
//            above when forks read it).
TorchKv::Plan TorchKv::PlanAppend(int64_t held) const {
  Plan p;
  size_t pieces = 0;
  if (held < base_) {
    p = Plan{held, 0, frozen_ > 0};
    pieces = SharedUpTo(held).size();
  } else if (frozen_ > 0 && held - base_ < frozen_) {
    p = Plan{held, 0, true};
    pieces = shared_.size() + (held > base_ ? 1 : 0);
  } else {
    p = Plan{base_, OwnRows(), frozen_ > 0};
    pieces = shared_.size();
  }
  if (pieces > kMaxShared) p = Plan{0, 0, frozen_ > 0};
  return p;
}

Status TorchKv::ShareFrom(KvCache& source, int64_t length) {
  auto* from = dynamic_cast<TorchKv*>(&source);
  if (from == nullptr || from->embed_dim_ != embed_dim_ || from->mk_.defined() || length < 0 ||
      length > from->AllocatedTokens() || own_ || base_ > 0) {
    return Status(StatusCode::kInternal, "kept keys and values: a fork between unlike caches");
  }
  shared_ = from->SharedUpTo(std::min(length, from->base_));
  if (length > from->base_) {
    const int64_t rows = length - from->base_;
    shared_.push_back(Shared{from->own_, rows});
    from->frozen_ = std::max(from->frozen_, rows);  // Its next steps write past them, or elsewhere.
  }
  base_ = length;
  return Status::Ok();
}

TorchKv::Window TorchKv::Memory() const {
  const int64_t b = mk_.size(0), lk = mk_.size(2);
  return {{mk_}, {mv_}, mkpm_.defined() ? mkpm_.view({b, 1, 1, lk}) : at::Tensor()};
}

std::optional<TorchKv::Placement> TorchKv::Placed() const {
  if (!own_ || !own_->slot || !shared_.empty() || base_ != 0 || own_->kpm.defined())
    return std::nullopt;
  return Placement{own_->slot->chunk(), own_->slot->start(), OwnRows()};
}

TorchKv::Window TorchKv::Append(int64_t held, int64_t capacity, const at::Tensor& kh,
                                const at::Tensor& vh, const at::Tensor& kpm) {
  const int64_t b = kh.size(0), h = kh.size(1), t = kh.size(2), d = kh.size(3);
  const auto opts = kh.options();
  Prepare(held, capacity, b, h, t, d, kpm.defined(), opts);
  bool padded = own_->kpm.defined() || kpm.defined();
  for (const Shared& s : shared_) padded = padded || s.block->kpm.defined();
  const int64_t off = held - base_;
  own_->k.narrow(2, off, t).copy_(kh);
  own_->v.narrow(2, off, t).copy_(vh);
  if (kpm.defined() && !own_->kpm.defined()) own_->kpm = KeptEmpty({b, OwnRows()}, opts).zero_();
  if (own_->kpm.defined()) {
    if (kpm.defined()) {
      own_->kpm.narrow(1, off, t).copy_(kpm);
    } else {
      own_->kpm.narrow(1, off, t).zero_();
    }
  }

  Window w;
  const int64_t lk = held + t;
  std::vector<at::Tensor> paddings;
  const auto add = [&](const KvBlock& block, int64_t rows) {
    w.k.push_back(block.k.narrow(2, 0, rows));
    w.v.push_back(block.v.narrow(2, 0, rows));
    if (padded) {
      paddings.push_back(block.kpm.defined() ? block.kpm.narrow(1, 0, rows)
                                             : at::zeros({b, rows}, opts));
    }
  };
  for (const Shared& s : shared_) add(*s.block, s.rows);
  add(*own_, off + t);
  if (padded) {
    w.kpm = (paddings.size() == 1 ? paddings[0] : at::cat(paddings, 1)).view({b, 1, 1, lk});
  }
  return w;
}

void TorchKv::Prepare(int64_t held, int64_t capacity, int64_t b, int64_t h, int64_t t, int64_t d,
                      bool padded_step, const at::TensorOptions& opts) {
  const Plan plan = PlanAppend(held);
  bool padded = padded_step || (own_ && own_->kpm.defined());
  for (const Shared& s : shared_) padded = padded || s.block->kpm.defined();

  // Every allocation first, then swapped in: a failed one leaves the session as it was.
  if (plan.shared == 0 && plan.own == 0 && base_ > 0) {
    // Compact: the first `held` tokens, wherever they lie, into one new block.
    std::shared_ptr<KvBlock> block = NewBlock(b, h, capacity, d, opts, padded);
    int64_t off = 0;
    std::vector<Shared> pieces = SharedUpTo(std::min(held, base_));
    if (held > base_) pieces.push_back(Shared{own_, held - base_});
    for (const Shared& s : pieces) {
      block->k.narrow(2, off, s.rows).copy_(s.block->k.narrow(2, 0, s.rows));
      block->v.narrow(2, off, s.rows).copy_(s.block->v.narrow(2, 0, s.rows));
      if (s.block->kpm.defined())
        block->kpm.narrow(1, off, s.rows).copy_(s.block->kpm.narrow(1, 0, s.rows));
      off += s.rows;
    }
    ReleaseOwn();
    shared_.clear();
    own_ = std::move(block);
    base_ = 0;
  } else if ((plan.own == 0 && plan.shared == held && (held != base_ || !own_ || frozen_ > 0)) ||
             (frozen_ > 0 && OwnRows() < held - base_ + t)) {
    // A new own block after `held`: trimmed back into its shared tokens, or its rows up to `held`,
    // which forks read, kept as a shared block (frozen; also when it must grow past them).
    std::shared_ptr<KvBlock> block = NewBlock(b, h, capacity - held, d, opts, padded);
    if (held < base_) {
      shared_ = SharedUpTo(held);
    } else if (held > base_) {
      shared_.push_back(Shared{own_, held - base_});
    }
    ReleaseOwn();
    own_ = std::move(block);
    base_ = held;
  } else if (OwnRows() < held - base_ + t) {
    // Grown: a private block copied into a larger one.
    std::shared_ptr<KvBlock> block = NewBlock(b, h, capacity - base_, d, opts, padded);
    const int64_t rows = held - base_;
    if (rows > 0) {
      block->k.narrow(2, 0, rows).copy_(own_->k.narrow(2, 0, rows));
      block->v.narrow(2, 0, rows).copy_(own_->v.narrow(2, 0, rows));
      if (own_->kpm.defined()) block->kpm.narrow(1, 0, rows).copy_(own_->kpm.narrow(1, 0, rows));
    }
    own_ = std::move(block);
  }
}

}  // namespace attnserve
