#include "server/engine/kept_attention.h"

#include <cmath>
#include <limits>
#include <optional>

#include "server/engine/torch_compat.h"
#include "server/engine/torch_tensors.h"

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

namespace {

// Whether a call's step can attend in a kept run: a session step asking for no weights, with no
// mask of its own (its session never had key padding: TorchKv::Placed), each sequence's tokens
// consecutive in its rows.
bool KeptRunTakes(const AttendCall& c) {
  return c.kv_use == AttendCall::Kv::kSession && c.is_causal && !c.key_padding_mask &&
         !c.attn_mask && c.weights == WeightsMode::kNone &&
         (c.batch_first() || c.batch == 1 || c.query_len == 1);
}

constexpr int64_t kCudaPoolChunkBytes = int64_t{1} << 30;
constexpr int64_t kCpuPoolChunkBytes = int64_t{16} << 20;

}  // namespace

std::unique_ptr<KeptRuns> KeptRuns::Make(const HeadAttentionOptions& heads, at::ScalarType dtype,
                                         DecoderHeads decoder, bool kernels, bool emulate,
                                         int64_t chunk_bytes, int64_t max_bytes) {
  Shape s;
  s.heads = heads.num_heads;
  s.kv_heads = heads.num_kv_heads > 0 ? heads.num_kv_heads : heads.num_heads;
  s.head_dim = heads.head_dim;
  s.scale = heads.scale > 0 ? heads.scale : 1.0 / std::sqrt(static_cast<double>(heads.head_dim));
  s.window = heads.window;
  s.device = heads.device;
  const int64_t kvh = s.kv_heads, d = s.head_dim;
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  const bool kernel =
      kernels && ((half && d % 8 == 0 && d <= 256) || (kvh == s.heads && !s.window));
  const bool extra_keys = heads.bias_k.defined() || heads.add_zero_attn;
  if (extra_keys || !(kernel || emulate)) return nullptr;
  if (chunk_bytes <= 0) chunk_bytes = s.device.is_cuda() ? kCudaPoolChunkBytes : kCpuPoolChunkBytes;
  const int64_t row = 2 * kvh * d * static_cast<int64_t>(c10::elementSize(dtype));
  auto pool = std::make_shared<KvPool>(kvh, d, at::TensorOptions().device(s.device).dtype(dtype),
                                       std::max<int64_t>(1, chunk_bytes / row),
                                       max_bytes > 0 ? std::max<int64_t>(1, max_bytes / row) : 0);
  return std::unique_ptr<KeptRuns>(new KeptRuns(s, std::move(decoder), emulate, std::move(pool)));
}

void KeptRuns::Attend(const std::vector<const AttendCall*>& calls,
                      const std::vector<at::Tensor>& qkv, const at::Tensor& merged,
                      const std::vector<int64_t>& q_off, std::vector<Attended>* attended,
                      std::vector<bool>* done) const {
  std::map<const KvPool::Chunk*, Run> runs;
  for (size_t i = 0; i < calls.size(); ++i) {
    const AttendCall& c = *calls[i];
    if ((*done)[i] || !KeptRunTakes(c)) continue;
    auto& kv = static_cast<TorchKv&>(*c.kv);
    kv.Prepare(c.kv_length, c.kv_capacity, c.batch, shape_.kv_heads, c.query_len, shape_.head_dim,
               /*padded_step=*/false, qkv[1].options());
    if (std::optional<TorchKv::Placement> at = kv.Placed()) {
      Run& run = runs[at->chunk.get()];
      run.chunk = at->chunk;
      run.steps.emplace_back(i, *at);
    }
  }
  for (const auto& [chunk, run] : runs) {
    if (const char* backend = AttendRun(calls, run, qkv, merged, q_off)) {
      for (const auto& [i, at] : run.steps) {
        (*attended)[i].backend = backend;
        (*done)[i] = true;
      }
    }
  }
}

// A kept run: its rows gathered from the batch's projections, normed and rotated at once, the new
// keys and values written to their rows of the chunk, the attention merged back into the batch's
// rows. Null (nothing written to `merged`; the calls then attend one by one, their rows rewritten
// in place) when no kernel takes it.
const char* KeptRuns::AttendRun(const std::vector<const AttendCall*>& calls, const Run& run,
                                const std::vector<at::Tensor>& qkv, const at::Tensor& merged,
                                const std::vector<int64_t>& q_off) const {
  const int64_t h = shape_.heads, kvh = shape_.kv_heads, d = shape_.head_dim;
  KeptSequences seqs;
  std::vector<int64_t> rows, to, pos;  // Per new token: its batch row, its chunk row, position.
  for (const auto& [i, at] : run.steps) {
    const AttendCall& c = *calls[i];
    const int64_t t = c.query_len, held = c.kv_length, first = c.query_position.value_or(held);
    for (int64_t b = 0; b < c.batch; ++b) {
      seqs.Add(t, at.start + b * at.stride, held + t);
      for (int64_t j = 0; j < t; ++j) {
        rows.push_back(q_off[i] + b * t + j);
        to.push_back(at.start + b * at.stride + held + j);
        pos.push_back(c.positions.empty() ? first + j : c.positions[b * t + j]);
      }
    }
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  rows.insert(rows.end(), to.begin(), to.end());
  rows.insert(rows.end(), pos.begin(), pos.end());
  const at::Tensor index = LongsOnDevice(rows, shape_.device);
  const at::Tensor in = index.narrow(0, 0, n);
  at::Tensor q = qkv[0].index_select(0, in).view({n, h, d});
  const at::Tensor k = qkv[1].index_select(0, in).view({n, kvh, d});
  const at::Tensor v = qkv[2].index_select(0, in).view({n, kvh, d});
  Rotation rot;  // The new tokens' queries and keys, at their positions.
  if (decoder_.inv_freq.defined())
    rot = RotationAt(index.narrow(0, 2 * n, n), decoder_.inv_freq, q.scalar_type());
  NormRotateInPlace(q, decoder_.q_norm, decoder_.eps, rot);
  NormRotateInPlace(k, decoder_.k_norm, decoder_.eps, rot);
  run.chunk->k.index_copy_(0, index.narrow(0, n, n), k);
  run.chunk->v.index_copy_(0, index.narrow(0, n, n), v);
  try {
    const KeptAttended a = AttendKept(q, *run.chunk, seqs, shape_.scale, shape_.window, emulate_);
    merged.index_copy_(0, in, a.out.reshape({n, h * d}).to(merged.scalar_type()));
    return a.backend;
  } catch (const c10::Error& e) {
    if (compat::IsOutOfMemory(e)) throw;
    return nullptr;
  }
}

}  // namespace attnserve
