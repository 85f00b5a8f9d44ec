#pragma once
// Kept keys and values on the model's device (memories and decoding sessions): their storage, how
// a session grows and appends, and how forks share it. One of the engine's LibTorch units (with
// torch_engine.cc); the model's math, which projects what is kept and attends over it, stays there.

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>
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

/// Kept keys and values of many sessions in few allocations, as varlen attention kernels read them
/// in place (LibTorch's flash attention with `cum_seq_k` as each sequence's first row and
/// `seqused_k` as its length): chunks of token-major rows, keys and values [rows, H, D] each,
/// handed out as slots of consecutive rows (a session's block: B sequences of `capacity` rows).
/// A step of many sessions then attends over all of them in one launch per chunk. A new chunk
/// holds max(`chunk_rows`, the slot) rows; a chunk is given back the moment its last slot is. Its
/// chunks hold at most `max_rows` rows in all (0: no bound): past it a block is allocated on its
/// own (its steps then attend alone), so that fragmentation, however the slots come and go, never
/// holds more than that beside what the budget counts.
/// Thread-safe. The CUDA engine's (LibTorch >= 2.11), and the CPU's under EngineOptions::Varlen::
/// kEmulate, where the tests check it.
class KvPool : public std::enable_shared_from_this<KvPool> {
 public:
  struct Chunk {
    at::Tensor k, v;  // [rows, H, D]
    int64_t rows = 0, used = 0;
    std::map<int64_t, int64_t> free;  // first row -> rows, coalesced
  };
  /// Rows [start, start + rows) of a chunk, given back when destroyed.
  class Slot {
   public:
    Slot(std::shared_ptr<KvPool> pool, std::shared_ptr<Chunk> chunk, int64_t start, int64_t rows)
        : pool_(std::move(pool)), chunk_(std::move(chunk)), start_(start), rows_(rows) {}
    ~Slot() { pool_->Release(*chunk_, start_, rows_); }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    const std::shared_ptr<Chunk>& chunk() const { return chunk_; }
    int64_t start() const { return start_; }
    int64_t rows() const { return rows_; }

   private:
    std::shared_ptr<KvPool> pool_;
    std::shared_ptr<Chunk> chunk_;
    int64_t start_, rows_;
  };
  /// `heads` key/value heads of `head_dim`, in `opts`' dtype and device.
  KvPool(int64_t heads, int64_t head_dim, const at::TensorOptions& opts, int64_t chunk_rows,
         int64_t max_rows = 0);
  /// The first free run of `rows` in a chunk, or a new chunk; null when a new chunk would pass
  /// max_rows. Throws as at::empty does when the device has no room; std::length_error past int32
  /// rows (the kernels' row offsets).
  std::unique_ptr<Slot> Allocate(int64_t rows);
  int64_t heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  const at::TensorOptions& options() const { return opts_; }
  /// Invariants' view (tests): chunks held, their rows in all and the rows of live slots.
  struct Usage {
    int64_t chunks = 0, rows = 0, used = 0;
  };
  Usage usage() const;

 private:
  void Release(Chunk& chunk, int64_t start, int64_t rows);
  const int64_t heads_, head_dim_, chunk_rows_, max_rows_;
  const at::TensorOptions opts_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Chunk>> chunks_;
};

/// One allocation of a session's keys and values: [B, H, rows, D] each, and the additive key
/// padding [B, rows] once some step sent one. Held by the session that writes it and by the forks
/// that read its first rows; freed with the last. From a KvPool, k and v are views of its slot's
/// token-major rows (sequence b's row r at slot row b * rows + r).
struct KvBlock {
  ~KvBlock();
  at::Tensor k, v, kpm;
  std::unique_ptr<KvPool::Slot> slot;  ///< Where k and v lie in a pool (null: their own).
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
  /// `pool`: where a session's blocks are allocated (null: each its own [B, H, rows, D] tensors).
  TorchKv(int64_t embed_dim, int64_t elem, std::shared_ptr<KvPool> pool = nullptr)
      : embed_dim_(embed_dim), elem_(elem), pool_(std::move(pool)) {}
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

  /// Append's first half: makes room for `t` tokens of `b` sequences of `h` heads of `d` after
  /// `held` (the same allocations, copies and swaps), writing nothing. Append after it changes no
  /// allocation. `padded_step`: a step that sends key padding.
  void Prepare(int64_t held, int64_t capacity, int64_t b, int64_t h, int64_t t, int64_t d,
               bool padded_step, const at::TensorOptions& opts);
  /// Where a prepared session's tokens lie when all of them are in one pool slot and it never had
  /// key padding (what one varlen launch over many sessions reads): sequence b's token j at row
  /// `start + b * stride + j` of `chunk`. Nullopt otherwise (forks' shared blocks, key padding, no
  /// pool): the step then attends on its own.
  struct Placement {
    std::shared_ptr<KvPool::Chunk> chunk;
    int64_t start = 0, stride = 0;
  };
  std::optional<Placement> Placed() const;

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
  const std::shared_ptr<KvPool> pool_;
  at::Tensor mk_, mv_, mkpm_;  // A memory's.
  // A session's: its first base_ tokens in shared_, the rest in own_, whose first frozen_ rows
  // forks read.
  std::vector<Shared> shared_;
  std::shared_ptr<KvBlock> own_;
  int64_t base_ = 0, frozen_ = 0;
};

}  // namespace attnserve
