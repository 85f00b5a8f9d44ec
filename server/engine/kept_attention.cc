#include "server/engine/kept_attention.h"

#include <limits>

#include "server/engine/torch_compat.h"

namespace attnserve {

void KeptSequences::Add(int64_t tokens, int64_t first_row, int64_t keys) {
  cu_q.push_back(cu_q.back() + static_cast<int32_t>(tokens));
  start.push_back(static_cast<int32_t>(first_row));
  used.push_back(static_cast<int32_t>(keys));
  max_q = std::max(max_q, tokens);
  max_k = std::max(max_k, keys);
}

namespace {

// Query t of a sequence of T new tokens over K keys is key K - T + t: it sees keys up to that one,
// and with a window the `window` keys ending there.
at::Tensor Emulated(const at::Tensor& q, const KvPool::Chunk& chunk, const KeptSequences& seqs,
                    double scale, int64_t window) {
  const int64_t h = q.size(1), group = h / chunk.k.size(1);
  at::Tensor out = at::empty_like(q);
  for (size_t s = 0; s < seqs.start.size(); ++s) {
    const int64_t t = seqs.cu_q[s + 1] - seqs.cu_q[s], keys = seqs.used[s];
    const at::Tensor qs = q.narrow(0, seqs.cu_q[s], t).to(at::kFloat).transpose(0, 1);  // [H,T,D]
    const auto heads = [&](const at::Tensor& all) {                                     // [H, K, D]
      return all.narrow(0, seqs.start[s], keys)
          .to(at::kFloat)
          .repeat_interleave(group, 1)
          .transpose(0, 1);
    };
    at::Tensor scores = at::matmul(qs, heads(chunk.k).transpose(1, 2)) * scale;  // [H, T, K]
    const auto opts = at::TensorOptions().dtype(at::kLong).device(q.device());
    const at::Tensor query_at = at::arange(keys - t, keys, opts).view({t, 1});
    const at::Tensor key_at = at::arange(0, keys, opts).view({1, keys});
    at::Tensor hidden = key_at > query_at;
    if (window > 0) hidden = hidden.logical_or(key_at <= query_at - window);
    scores.masked_fill_(hidden, -std::numeric_limits<float>::infinity());
    out.narrow(0, seqs.cu_q[s], t)
        .copy_(at::matmul(scores.softmax(-1), heads(chunk.v)).transpose(0, 1));
  }
  return out;
}

}  // namespace

KeptAttended AttendKept(const at::Tensor& q, const KvPool::Chunk& chunk, const KeptSequences& seqs,
                        double scale, int64_t window, bool emulate) {
  if (emulate) return {Emulated(q, chunk, seqs, scale, window), "kept_emulated"};
  // The sequences' bounds in one copy to the device: [cu_q (S + 1) | start (S + 1) | used (S)].
  const int64_t n = static_cast<int64_t>(seqs.used.size());
  std::vector<int32_t> host(seqs.cu_q);
  host.insert(host.end(), seqs.start.begin(), seqs.start.end());
  host.push_back(0);  // start's last entry: not read (the kernels take used instead)
  host.insert(host.end(), seqs.used.begin(), seqs.used.end());
  const at::Tensor all = at::from_blob(host.data(), {static_cast<int64_t>(host.size())}, at::kInt)
                             .to(q.device(), /*non_blocking=*/false, /*copy=*/true);
  const compat::VarlenOutput r = compat::KeptVarlenAttention(
      q, chunk.k, chunk.v, all.narrow(0, 0, n + 1), all.narrow(0, n + 1, n + 1),
      all.narrow(0, 2 * n + 2, n), seqs.max_q, seqs.max_k, scale, window);
  return {r.out, r.backend};
}

}  // namespace attnserve
