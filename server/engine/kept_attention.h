#pragma once
// Attention of many kept sessions' steps in one launch, over their keys and values where they lie
// in a KvPool chunk: LibTorch's varlen kernels on CUDA, the same computation per sequence
// elsewhere (how the CPU tests check the engine's kept runs). One of the engine's LibTorch units.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

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

}  // namespace attnserve
