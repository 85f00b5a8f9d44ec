#pragma once
// Kept keys and values on the model's device (memories and decoding sessions): their storage and
// how a session grows and appends. One of the engine's LibTorch units (with torch_engine.cc); the
// model's math, which projects what is kept and attends over it, stays there.

#include <ATen/ATen.h>

#include <optional>

#include "server/engine/attention_model.h"

namespace attnserve {

/// Storage for kept keys and values: on the CPU, pages of their own (mmap), given back to the
/// system the moment the entry ends. From the heap, long-lived entries among each request's
/// short-lived buffers kept freed memory from the system until the server went idle: 200 memories
/// of 4 MiB created under a 64 MiB budget grew the server by 532 MiB, now 107 MiB (ctest
/// kv_memory_peak).
at::Tensor KeptEmpty(at::IntArrayRef sizes, const at::TensorOptions& opts);

/// A memory's or session's keys and values on the model's device, in its compute dtype: heads
/// split, [B, H, capacity, D] each, so a session appends in place and attends over a view of the
/// first rows (no copy of the history per step; growing doubles the capacity,
/// AttendCall::kv_capacity).
class TorchKv final : public KvCache {
 public:
  TorchKv(int64_t embed_dim, int64_t elem) : embed_dim_(embed_dim), elem_(elem) {}
  std::optional<int64_t> BytesFor(int64_t batch, int64_t capacity) const override;
  int64_t AllocatedTokens() const override { return k_.defined() ? k_.size(2) : 0; }
  Status CopyFrom(const KvCache& source, int64_t length, int64_t capacity) override;

  /// Keeps a memory's heads-split keys or values [B, H, L, D], or its additive key padding [B, L]:
  /// one at a time, so each projection's temporary is gone before the next is made (the server's
  /// peak memory while memories are created, ctest kv_memory_peak).
  void KeepKeys(const at::Tensor& kh) { k_ = Kept(kh); }
  void KeepValues(const at::Tensor& vh) { v_ = Kept(vh); }
  void KeepPadding(const at::Tensor& kpm) { kpm_ = Kept(kpm); }

  /// What a session step attends over: all held + new keys and values, and their additive key
  /// padding as [B, 1, 1, Lk] (undefined when no step ever sent one).
  struct Window {
    at::Tensor k, v, kpm;
  };
  /// One session step's new keys and values (heads split, [B, H, T, D]) and additive key padding
  /// ([B, T], undefined: none) go after the `held` tokens, growing the storage to `capacity` first
  /// (all of it allocated before any is swapped in, so a failed allocation leaves the session as it
  /// was). The session's length is the store's: a step that fails after this is not counted, and
  /// the rows it wrote are overwritten by the next.
  Window Append(int64_t held, int64_t capacity, const at::Tensor& kh, const at::Tensor& vh,
                const at::Tensor& kpm);

  /// A memory's keys and values, and its key padding as [B, 1, 1, Lk] (undefined: none).
  Window Memory() const;

 private:
  static at::Tensor Kept(const at::Tensor& t) { return KeptEmpty(t.sizes(), t.options()).copy_(t); }

  const int64_t embed_dim_, elem_;
  at::Tensor k_, v_;  // [B, H, capacity, D]
  at::Tensor kpm_;    // [B, capacity] additive; undefined until some key padding mask arrives
};

}  // namespace attnserve
