#pragma once
// Attention of many kept sessions' steps in one launch, over their keys and values where they lie
// in a KvPool chunk: LibTorch's varlen kernels on CUDA, the same computation per sequence
// elsewhere (how the CPU tests check the engine's kept runs). KeptRuns finds a packed batch's runs
// (its session steps grouped by chunk), writes their new keys and values and attends each run in
// one launch. One of the engine's LibTorch units.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "server/core/types.h"
#include "server/engine/head_attention.h"
#include "server/engine/rotary.h"
#include "server/engine/torch_kv.h"

namespace attnserve {

/// The sequences of one kept run, in order: sequence s has cu_q[s + 1] - cu_q[s] new tokens
/// (queries, consecutive rows), and its keys are used[s] rows from row start[s] of the chunk, the
/// new tokens' last.
struct KeptSequences {
  std::vector<int32_t> cu_q{0}, start, used;
  int64_t max_q = 0, max_k = 0;
  void Add(int64_t tokens, int64_t first_row, int64_t keys);
};

struct KeptAttended {
  at::Tensor out;  ///< [n, H, D], q's dtype
  const char* backend = nullptr;
};

/// q [n, H, D] (the sequences' queries, normed and rotated), over `chunk`'s rows (grouped heads:
/// query head h reads key/value head h / (H / KVH)), causal from the bottom right, each query
/// seeing the `window` keys up to its own (0: all), scores scaled by `scale`. `emulate`: per
/// sequence, in float32, on any device; otherwise compat::KeptVarlenAttention (CUDA), which throws
/// c10::Error where no kernel takes the inputs.
KeptAttended AttendKept(const at::Tensor& q, const KvPool::Chunk& chunk, const KeptSequences& seqs,
                        double scale, int64_t window, bool emulate);

/// One model's kept runs: its sessions' kept keys and values in a KvPool, and their steps in a
/// packed batch attending in runs, one launch per pool chunk. Thread-safe.
class KeptRuns {
 public:
  /// For a model whose attention over heads is `heads` (its shape, scale, window, device and own
  /// keys), computing in `dtype`. Where a kernel takes its attention (`kernels`: LibTorch's varlen
  /// kernels run here): flash attention's (half precision, head_dim a multiple of 8 up to 256) or
  /// the memory-efficient kernel's (ungrouped, no window); every model under `emulate`. Null
  /// otherwise, and with keys of its own (bias_k/bias_v, add_zero_attn). Chunks of `chunk_bytes`
  /// (0: 1 GiB on CUDA, 16 MiB elsewhere), `max_bytes` in all (0: no bound).
  static std::unique_ptr<KeptRuns> Make(const HeadAttentionOptions& heads, at::ScalarType dtype,
                                        DecoderHeads decoder, bool kernels, bool emulate,
                                        int64_t chunk_bytes, int64_t max_bytes);

  /// The pool sessions' blocks are allocated from (TorchKv).
  const std::shared_ptr<KvPool>& pool() const { return pool_; }

  /// The session steps among `calls` (a packed batch's; not `done`) whose kept rows lie in one
  /// pool slot, grouped by chunk: each group's new keys and values (from qkv, the batch's
  /// self-attention rows' projections: q, k, v [rows, width], call i's from q_off[i]) are normed,
  /// rotated and written where they go, and its queries attend in one launch, their heads into
  /// `merged`'s rows; those calls are then `done`, with the kernel's name as their backend. The
  /// others (forks reading shared blocks, key padding, masks, weights) attend per call after.
  void Attend(const std::vector<const AttendCall*>& calls, const std::vector<at::Tensor>& qkv,
              const at::Tensor& merged, const std::vector<int64_t>& q_off,
              std::vector<Attended>* attended, std::vector<bool>* done) const;

 private:
  // What the runs need of the model's attention (scale 1/sqrt(head_dim) when it sets none).
  struct Shape {
    int64_t heads = 1, kv_heads = 1, head_dim = 1;
    double scale = 0;
    int64_t window = 0;
    at::Device device = at::kCPU;
  };
  KeptRuns(const Shape& shape, DecoderHeads decoder, bool emulate, std::shared_ptr<KvPool> pool)
      : shape_(shape), decoder_(std::move(decoder)), emulate_(emulate), pool_(std::move(pool)) {}
  // One chunk's steps: calls[i] with its placement.
  struct Run {
    std::shared_ptr<KvPool::Chunk> chunk;
    std::vector<std::pair<size_t, TorchKv::Placement>> steps;
  };
  const char* AttendRun(const std::vector<const AttendCall*>& calls, const Run& run,
                        const std::vector<at::Tensor>& qkv, const at::Tensor& merged,
                        const std::vector<int64_t>& q_off) const;

  const Shape shape_;
  const DecoderHeads decoder_;
  const bool emulate_;
  const std::shared_ptr<KvPool> pool_;
};

}  // namespace attnserve
