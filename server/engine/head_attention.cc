#include "server/engine/head_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "server/engine/small_attention.h"
#include "server/engine/torch_compat.h"
#include "server/engine/torch_tensors.h"

namespace attnserve {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The queries masked in every head, [B*Lq, 1] bool in the wire's row order, from each block's
// [B, n] (undefined: none in the block); undefined when no query is.
at::Tensor DeadRows(const std::vector<at::Tensor>& dead_blocks, int64_t rows, int64_t b, int64_t lq,
                    bool batch_first) {
  at::Tensor dead;  // [B, Lq]
  for (size_t block = 0; block < dead_blocks.size(); ++block) {
    if (!dead_blocks[block].defined()) continue;
    if (!dead.defined()) dead = at::zeros({b, lq}, at::TensorOptions().dtype(at::kBool));
    dead.narrow(1, static_cast<int64_t>(block) * rows, dead_blocks[block].size(1))
        .copy_(dead_blocks[block]);
  }
  if (!dead.defined()) return dead;
  return (batch_first ? dead : dead.t()).reshape({b * lq, 1});
}

}  // namespace

// One call's attention, as its blocks of queries share it.
struct HeadAttention::Job {
  const AttendCall& call;
  at::Tensor q_all;  // [B, H, Lq, D] ([B, KVH, Lq, G, D] when grouped), in float32 when widened
  std::vector<at::Tensor> ks, vs;
  at::Tensor attn_mask, kpm;
  at::TensorOptions like;  // the queries' options (the compute dtype)
  int64_t causal_offset = 0, extra = 0, rows = 1;
  bool fused = false, fused_causal = false, grouped = false;
  bool dense = false;       // products on dense copies (HeadAttentionOptions::dense_products)
  at::Tensor merged_heads;  // [B, H, Lq, D] view of the merged rows
  at::Tensor weights_out;   // [B, H or 1, Lq, S] over the answer's bytes (undefined: none)
  mutable std::vector<const char*> backends;
  mutable std::vector<at::Tensor> dead_blocks;  // [B, n] per block
};

Attended HeadAttention::Attend(const AttendCall& call, const at::Tensor& qh,
                               std::vector<at::Tensor> ks, std::vector<at::Tensor> vs,
                               const at::Tensor& kpm, int64_t causal_offset, const at::Tensor& dst,
                               AttendOutputs* out, const Parallel& parallel) const {
  const int64_t b = call.batch, lq = call.query_len, lk = call.key_len;
  const int64_t h = o_.num_heads, d = o_.head_dim;
  const bool want_weights = call.weights != WeightsMode::kNone;
  if (ks.size() > 1 && (o_.widen || Fused(want_weights))) {
    ks = {at::cat(ks, 2)};
    vs = {at::cat(vs, 2)};
  }
  AppendExtraKeys(b, qh.options(), &ks, &vs);
  Job job{call, qh, std::move(ks), std::move(vs), at::Tensor(), kpm, qh.options()};
  job.causal_offset = causal_offset;
  job.extra = (o_.bias_k.defined() ? 1 : 0) + (o_.add_zero_attn ? 1 : 0);
  const int64_t sl = lk + job.extra;
  job.grouped = group() > 1;
  if (job.grouped) {  // [B, H, Lq, D] -> [B, KVH, Lq, G, D], contiguous: a group's rows together.
    job.q_all = qh.unflatten(1, {kv_heads(), group()}).permute({0, 1, 3, 2, 4}).contiguous();
  }
  if (o_.widen) {  // Widened bfloat16: attention in float32.
    job.q_all = job.q_all.to(at::kFloat);
    for (at::Tensor& k : job.ks) k = k.to(at::kFloat);
    for (at::Tensor& v : job.vs) v = v.to(at::kFloat);
  }
  // The masks stay in their wire form ([Lq, Lk] or [B, H, Lq, Lk], bool or float) and become
  // additive one query block at a time.
  if (call.attn_mask) {
    job.attn_mask = Wrap(*call.attn_mask);
    if (job.attn_mask.dim() == 3) job.attn_mask = job.attn_mask.view({b, h, lq, lk});
  }
  job.fused = Fused(want_weights) && job.ks.size() == 1;
  // Decided for the call, not its blocks: an answer is the same whichever cores help.
  int64_t kv_bytes = 0;
  for (size_t i = 0; i < job.ks.size(); ++i)
    kv_bytes +=
        job.ks[i].numel() * job.ks[i].element_size() + job.vs[i].numel() * job.vs[i].element_size();
  job.dense = o_.dense_products && !job.fused && lq * group() > 1 && kv_bytes <= o_.dense_max_bytes;
  if (job.dense) {  // Keys and values dense, in one piece (a forked session's history joined).
    job.ks = {job.ks.size() == 1 ? job.ks[0].contiguous() : at::cat(job.ks, 2)};
    job.vs = {job.vs.size() == 1 ? job.vs[0].contiguous() : at::cat(job.vs, 2)};
  }
  // Query blocks: bounded by kBlockScores, and with idle cores one per core (4 * B*H*S*D flops a
  // query row: QK^T and PV).
  const int64_t width = products_.Blocks(parallel, lq, 4.0 * b * h * sl * d, 1);
  job.rows = std::max<int64_t>(
      1, std::min({lq, kBlockScores / std::max<int64_t>(1, b * h * sl), (lq + width - 1) / width}));
  const int64_t blocks = (lq + job.rows - 1) / job.rows;
  // The fused kernel applies a plain causal mask by itself when the whole query is one block.
  // (Not for grouped heads: their rows are a query's group, n * G of them, the mask's own.)
  job.fused_causal = job.fused && !job.grouped && call.is_causal && causal_offset == 0 &&
                     o_.window == 0 && !job.attn_mask.defined() && !kpm.defined() &&
                     job.extra == 0 && job.rows == lq;
  if (want_weights) {
    const int64_t heads = call.weights == WeightsMode::kPerHead ? h : 1;
    out->weights->resize(static_cast<size_t>(b * heads * lq * sl) * DTypeSize(call.query.dtype));
    job.weights_out = at::from_blob(out->weights->data(), {b, heads, lq, sl},
                                    at::TensorOptions().dtype(ToScalarType(call.query.dtype)));
  }
  Attended result;
  const at::Tensor merged = dst.defined() ? dst : at::empty({b * lq, h * d}, qh.options());
  job.merged_heads = call.batch_first() ? merged.view({b, lq, h, d}).transpose(1, 2)
                                        : merged.view({lq, b, h, d}).permute({1, 2, 0, 3});
  job.backends.assign(blocks, result.backend);
  job.dead_blocks.resize(blocks);
  products_.Pieces(parallel, blocks, [&](int64_t block) { RunBlock(job, block); });
  result.backend = job.backends[0];
  if (!dst.defined()) result.merged = merged;
  result.dead = DeadRows(job.dead_blocks, job.rows, b, lq, call.batch_first());
  return result;
}

void HeadAttention::AppendExtraKeys(int64_t b, const at::TensorOptions& like,
                                    std::vector<at::Tensor>* ks,
                                    std::vector<at::Tensor>* vs) const {
  const int64_t h = o_.num_heads, d = o_.head_dim;
  const auto append = [&](const at::Tensor& k, const at::Tensor& v) {
    if (ks->size() > 1) {
      ks->push_back(k);
      vs->push_back(v);
    } else {
      (*ks)[0] = at::cat({(*ks)[0], k}, 2);
      (*vs)[0] = at::cat({(*vs)[0], v}, 2);
    }
  };
  if (o_.bias_k.defined()) {
    append(o_.bias_k.view({1, h, 1, d}).expand({b, h, 1, d}),
           o_.bias_v.view({1, h, 1, d}).expand({b, h, 1, d}));
  }
  if (o_.add_zero_attn) append(at::zeros({b, h, 1, d}, like), at::zeros({b, h, 1, d}, like));
}

// Bfloat16 values' probabilities come from the softmax in bfloat16 where it writes them so (the
// own softmax); else in the scores' dtype (TimesValues rounds them).
at::ScalarType HeadAttention::ValuesDtype(const Job& job) const {
  return o_.own_softmax && job.vs[0].scalar_type() == at::kBFloat16 ? at::kBFloat16
                                                                    : at::ScalarType::Undefined;
}

void HeadAttention::RunBlock(const Job& job, int64_t block) const {
  const AttendCall& call = job.call;
  const int64_t q0 = block * job.rows, n = std::min(job.rows, call.query_len - q0);
  const BlockMask m =
      MaskFor(job.attn_mask, job.kpm, call.is_causal && !job.fused_causal, job.causal_offset, q0, n,
              call.key_len, job.extra, call.batch, job.like);
  const at::Tensor heads = job.merged_heads.narrow(2, q0, n);
  if (job.grouped) {
    const int64_t b = call.batch, kvh = kv_heads(), g = group(), d = o_.head_dim;
    at::Tensor qc = job.q_all.narrow(2, q0, n).reshape({b, kvh, n * g, d});
    if (job.dense) qc = qc.contiguous();
    at::Tensor grouped, p;
    if (job.fused) {  // A group's n * G rows as one head's queries over its key/value head.
      grouped =
          AttendFused(qc, job.ks[0], job.vs[0], Grouped(m, b, n), false, &job.backends[block]);
    } else {
      p = Probabilities(qc, job.ks, Grouped(m, b, n), ValuesDtype(job));
      grouped = at::empty({b, kvh, n * g, d}, heads.options().dtype(job.vs[0].scalar_type()));
      TimesValues(p, job.vs, grouped);
    }
    // [B, KVH, n, G, D] -> the merged heads' [B, KVH, G, n, D].
    heads.unflatten(1, {kvh, g}).copy_(grouped.view({b, kvh, n, g, d}).transpose(2, 3));
    if (job.weights_out.defined()) {
      const at::Tensor ph =
          p.view({b, kvh, n, g, p.size(-1)}).transpose(2, 3).reshape({b, kvh * g, n, p.size(-1)});
      job.weights_out.narrow(2, q0, n).copy_(
          call.weights == WeightsMode::kAveraged ? ph.mean(1, true) : ph);
    }
    if (m.any_dead) job.dead_blocks[block] = m.dead.squeeze(-1).all(1);
    return;
  }
  const at::Tensor qc = job.q_all.narrow(2, q0, n);
  if (job.fused) {
    heads.copy_(AttendFused(qc, job.ks[0], job.vs[0], m, job.fused_causal, &job.backends[block]));
  } else {
    const at::Tensor p =
        Probabilities(job.dense ? qc.contiguous() : qc, job.ks, m, ValuesDtype(job));
    if (job.dense) {  // Into dense rows of its own, then the merged rows.
      const at::Tensor own = at::empty(heads.sizes(), heads.options());
      TimesValues(p, job.vs, own);
      heads.copy_(own);
    } else {
      TimesValues(p, job.vs, heads);
    }
    if (job.weights_out.defined()) {
      job.weights_out.narrow(2, q0, n).copy_(
          call.weights == WeightsMode::kAveraged ? p.mean(1, true) : p);
    }
  }
  if (m.any_dead) job.dead_blocks[block] = m.dead.squeeze(-1).all(1);
}

HeadAttention::BlockMask HeadAttention::MaskFor(const at::Tensor& attn_mask, const at::Tensor& kpm,
                                                bool causal, int64_t causal_offset, int64_t q0,
                                                int64_t n, int64_t lk, int64_t extra, int64_t b,
                                                const at::TensorOptions& like) const {
  BlockMask r;
  // In the scores' dtype: a kept key padding is in the model's, the causal mask is made in it.
  const auto add = [&r, this](const at::Tensor& m) {
    const at::Tensor f = m.scalar_type() == o_.score_dtype ? m : m.to(o_.score_dtype);
    r.mask = r.mask.defined() ? r.mask + f : f;
  };
  if (attn_mask.defined()) {
    const at::Tensor m = attn_mask.narrow(-2, q0, n);
    add(AdditiveMask(m.dim() == 2 ? m.view({1, 1, n, lk}) : m, o_.device, o_.score_dtype));
  }
  if (kpm.defined()) add(kpm);
  // Query q0 + i may attend key j only when j <= q0 + i + causal_offset. No key lies beyond the
  // block's first query (a one-token decoding step, the last row): nothing to mask.
  if (causal && causal_offset + q0 + 1 < lk) {
    const at::Tensor upper =
        at::ones({n, lk}, at::TensorOptions().dtype(at::kBool).device(o_.device))
            .triu(causal_offset + q0 + 1);
    add(at::zeros({1, 1, n, lk}, like).masked_fill_(upper.view({1, 1, n, lk}), kNegInf));
  }
  // With a window, query q0 + i sees key j only when j > q0 + i + causal_offset - window.
  if (o_.window > 0 && causal_offset + q0 + n - 1 - o_.window >= 0) {
    const at::Tensor lower =
        at::ones({n, lk}, at::TensorOptions().dtype(at::kBool).device(o_.device))
            .tril(causal_offset + q0 - o_.window);
    add(at::zeros({1, 1, n, lk}, like).masked_fill_(lower.view({1, 1, n, lk}), kNegInf));
  }
  if (!r.mask.defined()) return r;
  if (extra > 0) r.mask = at::constant_pad_nd(r.mask, {0, extra}, 0);
  // (head, query) rows whose every key is masked: PyTorch's softmax gives NaN there; we give 0.
  r.dead = r.mask.eq(kNegInf).all(-1, /*keepdim=*/true).expand({b, o_.num_heads, n, 1});
  r.any_dead = r.dead.any().item<bool>();
  return r;
}

at::Tensor HeadAttention::Probabilities(const at::Tensor& qc, const std::vector<at::Tensor>& ks,
                                        const BlockMask& m, at::ScalarType dtype) const {
  const int64_t b = qc.size(0), h = qc.size(1), n = qc.size(2);
  int64_t sl = 0;
  for (const at::Tensor& k : ks) sl += k.size(2);
  const double scale = o_.scale > 0 ? o_.scale : 1.0 / std::sqrt(static_cast<double>(o_.head_dim));
  // Per batch element, scale·q·kᵀ plus the mask, then the softmax in place. The scores are in the
  // scores' dtype: float32 for CPU bfloat16, from the products' float32 accumulators, so that
  // neither the mask nor the softmax sees bfloat16 rounding (a score of 50 rounds by 0.25). Zeroed
  // when LibTorch's baddbmm writes them with no mask to add: its small-matrix kernel in 1.13 reads
  // its input even with beta 0 (0 · NaN of uninitialised memory is NaN). Wider scores come from
  // oneDNN, which only writes.
  const auto opts = qc.options().dtype(o_.score_dtype);
  at::Tensor p = m.mask.defined() || o_.score_dtype != qc.scalar_type() || OnednnAttends(qc)
                     ? at::empty({b, h, n, sl}, opts)
                     : at::zeros({b, h, n, sl}, opts);
  for (int64_t bi = 0; bi < b; ++bi) {
    at::Tensor pb = p.select(0, bi);
    const at::Tensor mb = m.mask.defined()
                              ? m.mask.select(0, m.mask.size(0) == 1 ? 0 : bi).expand({h, n, sl})
                              : at::Tensor();
    int64_t off = 0;
    for (const at::Tensor& kp : ks) {  // The scores of each piece of keys, in place.
      const int64_t rows = kp.size(2);
      const bool whole = ks.size() == 1;
      ScoresInto(whole ? pb : pb.narrow(-1, off, rows), qc.select(0, bi),
                 kp.select(0, bi).transpose(-2, -1),
                 !mb.defined() || whole ? mb : mb.narrow(-1, off, rows), scale);
      off += rows;
    }
  }
  at::Tensor probs = SmallSoftmax(p, dtype);
  if (!probs.defined()) {
    at::_softmax_out(p, p, -1, /*half_to_float=*/false);
    probs = dtype == at::ScalarType::Undefined || dtype == p.scalar_type() ? p : p.to(dtype);
  }
  if (m.any_dead) probs.masked_fill_(m.dead, 0);
  return probs;
}

void HeadAttention::TimesValues(const at::Tensor& p, const std::vector<at::Tensor>& vs,
                                const at::Tensor& heads) const {
  const at::ScalarType vt = vs[0].scalar_type();
  // In the values' dtype (bfloat16 probabilities, as fused CPU kernels multiply them).
  const at::Tensor pv = p.scalar_type() == vt ? p : p.to(vt);
  for (int64_t bi = 0; bi < p.size(0); ++bi) {
    at::Tensor out_b = heads.select(0, bi);
    // Widened: the float32 result, rounded into the merged rows.
    at::Tensor acc =
        out_b.scalar_type() == vt ? out_b : at::empty(out_b.sizes(), out_b.options().dtype(vt));
    const at::Tensor pb = pv.select(0, bi);
    if (acc.is_same(out_b)) {  // A few rows a head: small_attention's kernels, piece by piece.
      bool small = true;
      int64_t off = 0;
      for (size_t i = 0; small && i < vs.size(); ++i) {
        const int64_t rows = vs[i].size(2);
        small = SmallTimesValues(vs.size() == 1 ? pb : pb.narrow(-1, off, rows),
                                 vs[i].select(0, bi), out_b, i > 0);
        off += rows;
      }
      if (small) continue;  // (The first piece decides: the rest are shaped alike.)
    }
    // One piece of values on the CPU: oneDNN writes the strided merged rows itself (LibTorch's bmm
    // multiplies into a contiguous temporary and reorders it there).
    if (vs.size() == 1 && acc.is_same(out_b) && OnednnAttends(pb) &&
        onednn::Matmul(ViewOf(pb), ViewOf(vs[0].select(0, bi)), ViewOf(out_b), 1.0f))
      continue;
    int64_t off = 0;
    for (size_t i = 0; i < vs.size(); ++i) {  // Summed over the pieces of values.
      const int64_t rows = vs[i].size(2);
      const at::Tensor pp = vs.size() == 1 ? pb : pb.narrow(-1, off, rows);
      if (i == 0) {
        at::bmm_out(acc, pp, vs[i].select(0, bi));
      } else {
        acc.baddbmm_(pp, vs[i].select(0, bi));
      }
      off += rows;
    }
    if (!acc.is_same(out_b)) out_b.copy_(acc);
  }
}

at::Tensor HeadAttention::AttendFused(const at::Tensor& qc, const at::Tensor& k,
                                      const at::Tensor& v, const BlockMask& m, bool causal,
                                      const char** backend) const {
  *backend = compat::FusedSdpaBackend(qc, k, v, m.mask, causal);
  at::Tensor attn = compat::FusedSdpa(qc, k, v, m.mask, causal);
  return m.any_dead ? attn.masked_fill(m.dead, 0) : attn;
}

void HeadAttention::ScoresInto(at::Tensor pp, const at::Tensor& q, const at::Tensor& kt,
                               const at::Tensor& mask, double scale) const {
  if (SmallScores(pp, q, kt, scale)) {
    if (mask.defined()) pp.add_(mask);
    return;
  }
  // Scores wider than the operands (float32 from bfloat16) come from oneDNN, which keeps its
  // float32 accumulators (LibTorch's products would round them to bfloat16); the mask is then
  // added in float32.
  if (pp.scalar_type() == q.scalar_type() && !OnednnAttends(q)) {
    if (mask.defined()) {
      at::baddbmm_out(pp, mask, q, kt, /*beta=*/1, /*alpha=*/scale);
    } else {
      at::baddbmm_out(pp, pp, q, kt, /*beta=*/0, /*alpha=*/scale);
    }
    return;
  }
  if (!(o_.device.is_cpu() &&
        onednn::Matmul(ViewOf(q), ViewOf(kt), ViewOf(pp), static_cast<float>(scale)))) {
    at::bmm_out(pp, q.to(pp.scalar_type()), kt.to(pp.scalar_type()));
    pp.mul_(scale);
  }
  if (mask.defined()) pp.add_(mask);
}

HeadAttention::BlockMask HeadAttention::Grouped(const BlockMask& m, int64_t b, int64_t n) const {
  if (!m.mask.defined()) return m;
  const int64_t kvh = kv_heads(), g = group();
  BlockMask r;
  r.any_dead = m.any_dead;
  const at::Tensor& mask = m.mask;  // [B' or 1, 1 or H, n or 1, S]
  const int64_t bm = mask.size(0), s = mask.size(-1);
  if (mask.size(1) == 1) {
    r.mask = mask.unsqueeze(3).expand({bm, 1, n, g, s}).reshape({bm, 1, n * g, s});
  } else {
    r.mask = mask.unflatten(1, {kvh, g})
                 .transpose(2, 3)
                 .expand({bm, kvh, n, g, s})
                 .reshape({bm, kvh, n * g, s});
  }
  r.dead = m.dead.unflatten(1, {kvh, g}).transpose(2, 3).reshape({b, kvh, n * g, 1});
  return r;
}

bool HeadAttention::OnednnAttends(const at::Tensor& t) const {
  return o_.device.is_cpu() &&
         (t.scalar_type() == at::kBFloat16 || (t.scalar_type() == at::kFloat && o_.onednn_float32));
}

bool HeadAttention::SmallScores(const at::Tensor& pp, const at::Tensor& q, const at::Tensor& kt,
                                double scale) const {
  if (!o_.small_products || q.scalar_type() != at::kFloat || kt.scalar_type() != at::kFloat ||
      pp.scalar_type() != at::kFloat || q.stride(-1) != 1 || kt.stride(-2) != 1 ||
      pp.stride(-1) != 1) {
    return false;
  }
  const int64_t heads = q.size(0), m = q.size(1), d = q.size(2), n = kt.size(2);
  for (int64_t h = 0; h < heads; ++h) {
    if (!small_attention::Scores(q.data_ptr<float>() + h * q.stride(0), q.stride(1), m,
                                 kt.data_ptr<float>() + h * kt.stride(0), kt.stride(2), n, d,
                                 static_cast<float>(scale), pp.data_ptr<float>() + h * pp.stride(0),
                                 pp.stride(1), o_.kernels)) {
      return false;  // (Only at h = 0: every head is shaped alike.)
    }
  }
  return true;
}

at::Tensor HeadAttention::SmallSoftmax(const at::Tensor& p, at::ScalarType dtype) const {
  if (!o_.own_softmax || p.scalar_type() != at::kFloat || !p.is_contiguous() || p.numel() == 0)
    return at::Tensor();
  const int64_t n = p.size(-1);
  if (dtype == at::kBFloat16) {
    at::Tensor out = at::empty(p.sizes(), p.options().dtype(at::kBFloat16));
    return small_attention::SoftmaxToBfloat16(p.data_ptr<float>(), n, p.numel() / n, n,
                                              reinterpret_cast<uint16_t*>(out.data_ptr()), n,
                                              o_.kernels)
               ? out
               : at::Tensor();
  }
  if (dtype != at::ScalarType::Undefined && dtype != at::kFloat) return at::Tensor();
  return small_attention::Softmax(p.data_ptr<float>(), n, p.numel() / n, n, o_.kernels)
             ? p
             : at::Tensor();
}

bool HeadAttention::SmallTimesValues(const at::Tensor& p, const at::Tensor& v,
                                     const at::Tensor& out, bool accumulate) const {
  if (!o_.small_products || p.scalar_type() != at::kFloat || v.scalar_type() != at::kFloat ||
      out.scalar_type() != at::kFloat || p.stride(-1) != 1 || v.stride(-1) != 1 ||
      out.stride(-1) != 1) {
    return false;
  }
  const int64_t heads = p.size(0), m = p.size(1), n = v.size(1), d = v.size(2);
  for (int64_t h = 0; h < heads; ++h) {
    if (!small_attention::TimesValues(p.data_ptr<float>() + h * p.stride(0), p.stride(1), m,
                                      v.data_ptr<float>() + h * v.stride(0), v.stride(1), n, d,
                                      out.data_ptr<float>() + h * out.stride(0), out.stride(1),
                                      accumulate, o_.kernels)) {
      return false;  // (Only at h = 0: every head is shaped alike.)
    }
  }
  return true;
}

}  // namespace attnserve
