#include "server/engine/varlen_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/engine/torch_compat.h"

namespace attnserve {
namespace {

// The varlen computation by plain per-sequence attention, on any device (VarlenMode::kEmulate).
void AttendBySequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                      bool causal, double scale, const at::Tensor& dst, const Products& products) {
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const int64_t lq = cu_q[s + 1] - cu_q[s], lk = cu_k[s + 1] - cu_k[s];
    const at::Tensor qs = q.narrow(0, cu_q[s], lq).transpose(0, 1);  // [H, Lq, D]
    const at::Tensor ks = k.narrow(0, cu_k[s], lk).transpose(0, 1);
    const at::Tensor vs = v.narrow(0, cu_k[s], lk).transpose(0, 1);
    at::Tensor scores = products.Matmul(qs * scale, ks.transpose(-2, -1));
    if (causal) {
      const at::Tensor upper =
          at::ones({lq, lk}, at::TensorOptions().dtype(at::kBool).device(q.device())).triu(1);
      scores.masked_fill_(upper, -std::numeric_limits<double>::infinity());
    }
    dst.narrow(0, cu_q[s], lq).copy_(products.Matmul(at::softmax(scores, -1), vs).transpose(0, 1));
  }
}

}  // namespace

const char* AttendVarlen(const std::vector<const AttendCall*>& calls,
                         const std::vector<size_t>& group, const RowsOf& rows_of,
                         const at::Tensor& merged, const std::vector<int64_t>& q_off, int64_t heads,
                         int64_t head_dim, VarlenMode mode, const Products& products) {
  const int64_t h = heads, d = head_dim;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t max_q = 0, max_k = 0;
  bool square = true;
  for (size_t i : group) {
    const AttendCall& c = *calls[i];
    for (int64_t bi = 0; bi < c.batch; ++bi) {
      cu_q.push_back(cu_q.back() + static_cast<int32_t>(c.query_len));
      cu_k.push_back(cu_k.back() + static_cast<int32_t>(c.key_len));
    }
    max_q = std::max(max_q, c.query_len);
    max_k = std::max(max_k, c.key_len);
    square = square && c.query_len == c.key_len;
  }
  const bool causal = calls[group[0]]->is_causal;
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  // The group's rows: consecutive in q (and, for cross-attention, in k and v) by construction.
  const QkvRows rows = rows_of(group[0], total_q, total_k);
  const at::Tensor q = rows.q.view({total_q, h, d});
  const at::Tensor k = rows.k.view({total_k, h, d});
  const at::Tensor v = rows.v.view({total_k, h, d});
  const at::Tensor dst = merged.narrow(0, q_off[group[0]], total_q).view({total_q, h, d});
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (mode == VarlenMode::kEmulate) {
    AttendBySequence(q, k, v, cu_q, cu_k, causal, scale, dst, products);
    return "varlen_emulated";
  }
  try {
    const auto to_device = [&](const std::vector<int32_t>& cu) {
      return at::from_blob(const_cast<int32_t*>(cu.data()), {static_cast<int64_t>(cu.size())},
                           at::kInt)
          .to(merged.device(), /*non_blocking=*/false, /*copy=*/true);
    };
    const compat::VarlenOutput r = compat::VarlenAttention(
        q, k, v, to_device(cu_q), to_device(cu_k), max_q, max_k, causal, square, scale);
    dst.copy_(r.out);
    return r.backend;
  } catch (const c10::Error& e) {
    if (compat::IsOutOfMemory(e)) throw;
    return nullptr;  // Not for these inputs (e.g. a head size the kernel lacks): per call.
  }
}

}  // namespace attnserve
