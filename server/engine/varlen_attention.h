#pragma once
// Varlen runs: the calls of a packed batch whose rows lie consecutive in its projections (one kind:
// self or cross, causal or not), every batch element a sequence, attending in one launch of
// LibTorch's varlen kernels (CUDA), or by plain per-sequence attention under emulation (what the
// CPU tests run to check the packing around the kernel). One of the engine's LibTorch units.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "server/core/types.h"
#include "server/engine/products.h"

namespace attnserve {

/// A call's projected rows, in the wire's row order: q [B*Lq, E], k and v [B*Lk, E].
struct QkvRows {
  at::Tensor q, k, v;
};

/// How a packed batch's calls attend: kKernel = LibTorch's varlen kernels (CUDA), kEmulate = the
/// same packing by per-sequence attention (tests), kOff = per call.
enum class VarlenMode { kOff, kKernel, kEmulate };

/// The projected rows from call i's on: rq query rows, rk key and value rows.
using RowsOf = std::function<QkvRows(size_t i, int64_t rq, int64_t rk)>;

/// One varlen attention over `group` (indices of `calls`: same kind, eligible, consecutive in the
/// packed rows) of a model of `heads` heads of `head_dim`; the heads go straight into `merged`'s
/// rows (call i's from q_off[i]). Returns the kernel's name, or nullptr when the kernel refused
/// the inputs (the calls then attend one by one). `mode` kKernel or kEmulate; `products` multiply
/// the emulation's scores and values.
const char* AttendVarlen(const std::vector<const AttendCall*>& calls,
                         const std::vector<size_t>& group, const RowsOf& rows_of,
                         const at::Tensor& merged, const std::vector<int64_t>& q_off, int64_t heads,
                         int64_t head_dim, VarlenMode mode, const Products& products);

}  // namespace attnserve
