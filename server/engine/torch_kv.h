#pragma once
// Kept keys and values on the model's device (memories and decoding sessions): their storage, how
// a session grows and appends, and how forks share it. One of the engine's LibTorch units (with
// torch_engine.cc); the model's math, which projects what is kept and attends over it, stays there.

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <vector>

#include "server/engine/attention_model.h"

namespace attnserve {

/// Storage for kept keys and values: on the CPU, pages of their own (mmap), given back to the
/// system the moment the entry ends. From the heap, long-lived entries among each request's
/// short-lived buffers kept freed memory from the system until the server went idle: 200 memories
/// of 4 MiB created under a 64 MiB budget grew the server by 532 MiB, now 107 MiB (ctest
/// kv_memory_peak).
at::Tensor KeptEmpty(at::IntArrayRef sizes, const at::TensorOptions& opts);

/// One allocation of a session's keys and values: [B, H, rows, D] each, and the additive key
/// padding [B, rows] once some step sent one. Held by the session that writes it and by the forks
/// that read its first rows; freed with the last.
struct KvBlock {
  ~KvBlock();
  at::Tensor k, v, kpm;
  int64_t bytes = 0;  ///< TorchKv::BytesFor(B, rows): what it counts against the budget.
  /// Set once no session counts the block as its own while others still read it: it counts
  /// itself there until freed.
  std::shared_ptr<KvLedger> ledger;
};

/// A memory's or session's keys and values on the model's device, in its compute dtype, heads
/// split. A session's tokens: first the rows of shared blocks (a fork's history, read only), then
/// its own block, where steps append in place; a step attends over views of those rows, no copy of
/// the history (growing doubles the own block, AttendCall::kv_capacity). ForkSession shares the
/// parent's rows with the fork (ShareFrom: no copy); a later step of either that would overwrite
/// rows the other reads starts a new own block instead, the old one kept as a shared block. Past
/// kMaxShared shared blocks a step copies the history into one own block again (beam search forks
/// every step: that copy comes once every kMaxShared generations).
class TorchKv final : public KvCache {
 public:
  static constexpr size_t kMaxShared = 8;
  TorchKv(int64_t embed_dim, int64_t elem) : embed_dim_(embed_dim), elem_(elem) {}
  ~TorchKv() override;
  std::optional<int64_t> BytesFor(int64_t batch, int64_t capacity) const override;
  int64_t AllocatedTokens() const override;
  int64_t SharedTokens() const override { return base_; }
  Plan PlanAppend(int64_t held) const override;
  Status ShareFrom(KvCache& source, int64_t length) override;

  /// Keeps a memory's heads-split keys or values [B, H, L, D], or its additive key padding [B, L]:
  /// one at a time, so each projection's temporary is gone before the next is made (the server's
  /// peak memory while memories are created, ctest kv_memory_peak).
  void KeepKeys(const at::Tensor& kh) { mk_ = Kept(kh); }
  void KeepValues(const at::Tensor& vh) { mv_ = Kept(vh); }
  void KeepPadding(const at::Tensor& kpm) { mkpm_ = Kept(kpm); }

  /// What a step attends over: keys and values as consecutive pieces along the sequence ([B, H,
  /// rows, D] views, most often one), and the additive key padding of all of them as [B, 1, 1, Lk]
  /// (undefined when no step ever sent one).
  struct Window {
    std::vector<at::Tensor> k, v;
    at::Tensor kpm;
  };
  /// One session step's new keys and values (heads split, [B, H, T, D]) and additive key padding
  /// ([B, T], undefined: none) go after the `held` tokens, in a cache of `capacity` tokens (the
  /// store's PlanAppend-based reservation): a new own block is allocated whole before anything is
  /// swapped in, so a failed allocation leaves the session as it was. The session's length is the
  /// store's: a step that fails after this is not counted, and the rows it wrote are overwritten by
  /// the next.
  Window Append(int64_t held, int64_t capacity, const at::Tensor& kh, const at::Tensor& vh,
                const at::Tensor& kpm);

  /// A memory's keys and values, and its key padding as [B, 1, 1, Lk] (undefined: none).
  Window Memory() const;

 private:
  struct Shared {
    std::shared_ptr<KvBlock> block;
    int64_t rows = 0;
  };
  static at::Tensor Kept(const at::Tensor& t) { return KeptEmpty(t.sizes(), t.options()).copy_(t); }
  int64_t OwnRows() const { return own_ ? own_->k.size(2) : 0; }
  // The shared blocks covering the first `tokens` tokens (those past it dropped, the last cut).
  std::vector<Shared> SharedUpTo(int64_t tokens) const;
  // Lets go of the own block; one forks still read counts itself from now on.
  void ReleaseOwn();
  std::shared_ptr<KvBlock> NewBlock(int64_t b, int64_t h, int64_t rows, int64_t d,
                                    const at::TensorOptions& opts, bool padding) const;

  const int64_t embed_dim_, elem_;
  at::Tensor mk_, mv_, mkpm_;  // A memory's.
  // A session's: its first base_ tokens in shared_, the rest in own_, whose first frozen_ rows
  // forks read.
  std::vector<Shared> shared_;
  std::shared_ptr<KvBlock> own_;
  int64_t base_ = 0, frozen_ = 0;
};

}  // namespace attnserve
