// The LibTorch model: nn.MultiheadAttention's computation over request bytes, composed of the
// products (products.h) on the kernels chosen at load (kernel_choice.h), attention over heads
// (head_attention.h), kept keys and values (torch_kv.h) and their kept runs (kept_attention.h),
// varlen runs (varlen_attention.h) and the batch's bytes to and from the device
// (batch_transfer.h); the projections, the packing of small calls into shared GEMMs, a decoder's
// rotations and the answers' bytes are here. LibTorch is seen by the engine's translation units
// only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "server/core/checked_math.h"
#include "server/core/packing_plan.h"
#include "server/engine/attention_model.h"
#include "server/engine/batch_transfer.h"
#include "server/engine/blas.h"
#include "server/engine/device_support.h"
#include "server/engine/head_attention.h"
#include "server/engine/kept_attention.h"
#include "server/engine/kernel_choice.h"
#include "server/engine/onednn.h"
#include "server/engine/products.h"
#include "server/engine/rotary.h"
#include "server/engine/torch_compat.h"
#include "server/engine/torch_kv.h"
#include "server/engine/torch_tensors.h"
#include "server/engine/varlen_attention.h"

namespace attnserve {
namespace {

class TorchModel final : public AttentionModel {
 public:
  TorchModel(const ModelWeights& w, at::Device device, DType dtype, EngineOptions::Varlen varlen,
             double min_piece_flops, bool force_widen, int64_t pack_rows,
             std::shared_ptr<HostStaging> staging, int64_t kv_pool_chunk_bytes,
             int64_t kv_pool_max_bytes)
      : spec_(w.spec),
        pack_rows_(pack_rows > 0      ? pack_rows
                   : device.is_cuda() ? std::numeric_limits<int64_t>::max()
                                      : kCpuPackRows),
        device_(device),
        dtype_(ToScalarType(dtype)),
        score_dtype_(device.is_cpu() ? at::kFloat : dtype_),
        choice_(ChooseKernels(device, dtype_, force_widen)),
        transfer_(device, dtype_, choice_.kernels, std::move(staging)),
        products_(device, dtype_, min_piece_flops, choice_.widen,
                  choice_.small_packed ? Products::kSmallPackedRows : 0),
        varlen_(varlen == EngineOptions::Varlen::kEmulate ? VarlenMode::kEmulate
                : varlen == EngineOptions::Varlen::kAuto && device.is_cuda() && compat::kHasVarlen
                    ? VarlenMode::kKernel
                    : VarlenMode::kOff) {
    spec_.device = device.str();
    spec_.compute_dtype = dtype;
    const int64_t wq = spec_.q_width(), wkv = spec_.kv_width();
    // Projection weights in float32 when bfloat16 products are widened (no widening per call).
    const auto opts = at::TensorOptions().device(device).dtype(choice_.widen ? at::kFloat : dtype_);
    proj_.fused_in = spec_.kdim == spec_.embed_dim && spec_.vdim == spec_.embed_dim;
    if (proj_.fused_in) {
      // One [3E, E] matrix: self-attention projects q, k and v in a single matmul; q, k and v
      // are its row blocks.
      proj_.in.w =
          at::cat({FromHost(w.q_proj, opts), FromHost(w.k_proj, opts), FromHost(w.v_proj, opts)});
      proj_.q.w = proj_.in.w.narrow(0, 0, wq);
      proj_.k.w = proj_.in.w.narrow(0, wq, wkv);
      proj_.v.w = proj_.in.w.narrow(0, wq + wkv, wkv);
    } else {
      proj_.q.w = FromHost(w.q_proj, opts);
      proj_.k.w = FromHost(w.k_proj, opts);
      proj_.v.w = FromHost(w.v_proj, opts);
    }
    if (w.in_proj_bias) {
      proj_.in.b = FromHost(*w.in_proj_bias, opts);
      proj_.q.b = proj_.in.b.narrow(0, 0, wq);
      proj_.k.b = proj_.in.b.narrow(0, wq, wkv);
      proj_.v.b = proj_.in.b.narrow(0, wq + wkv, wkv);
    }
    // out_proj.weight transposed and contiguous ([in, out], what the BLAS reads), viewed as [out,
    // in].
    proj_.out.w = FromHost(w.out_proj, opts).t().contiguous().t();
    if (w.out_proj_bias) proj_.out.b = FromHost(*w.out_proj_bias, opts);
    if (device.is_cpu()) PackWeights(w, spec_, dtype_, choice_, &proj_);
    const HeadAttentionOptions heads = HeadOptions(w, opts);
    heads_ = std::make_unique<HeadAttention>(heads, products_);
    spec_.kernels = DescribeKernels(choice_, proj_, heads_->Fused(false), device_, dtype_);
    kept_ = KeptRuns::Make(heads, dtype_, decoder_, varlen_ == VarlenMode::kKernel,
                           varlen_ == VarlenMode::kEmulate, kv_pool_chunk_bytes, kv_pool_max_bytes);
  }

  // How its attention over heads computes: the model's shape, a decoder's scale and window, its
  // own keys (bias_k/bias_v, add_zero_attn), and the kernels ChooseAttention picks for them.
  // `opts`: the projection weights' options.
  HeadAttentionOptions HeadOptions(const ModelWeights& w, const at::TensorOptions& opts) {
    HeadAttentionOptions heads;
    heads.num_heads = spec_.num_heads;
    heads.num_kv_heads = spec_.kv_heads();
    heads.head_dim = spec_.head_dim();
    if (spec_.decoder) SetUpDecoder(w, opts, &heads);
    if (w.bias_k) {
      heads.bias_k = FromHost(*w.bias_k, opts.dtype(dtype_));
      heads.bias_v = FromHost(*w.bias_v, opts.dtype(dtype_));
    }
    heads.add_zero_attn = spec_.add_zero_attn;
    ChooseAttention(spec_, device_, dtype_, score_dtype_, &choice_, &heads);
    return heads;
  }

  // A decoder's attention: scale and window, its q/k RMSNorm weights in the compute dtype (the
  // checkpoint's module multiplies in its dtype), RoPE's frequencies in float32, as transformers
  // computes its angles.
  void SetUpDecoder(const ModelWeights& w, const at::TensorOptions& opts,
                    HeadAttentionOptions* heads) {
    const DecoderSpec& dec = *spec_.decoder;
    heads->scale = dec.scale;
    heads->window = dec.sliding_window;
    decoder_.eps = dec.rms_norm_eps;
    if (w.q_norm) decoder_.q_norm = FromHost(*w.q_norm, opts.dtype(dtype_));
    if (w.k_norm) decoder_.k_norm = FromHost(*w.k_norm, opts.dtype(dtype_));
    if (dec.rotary) decoder_.inv_freq = RotaryInverseFrequencies(*dec.rotary).to(device_);
  }

  const ModelSpec& spec() const override { return spec_; }

  Status Forward(const AttendCall& call, AttendOutputs* out) const override {
    return ForwardOne(call, out, SerialParallel());
  }

  std::shared_ptr<KvCache> NewKvCache() const override {
    return std::make_shared<TorchKv>(spec_.kv_width(),
                                     static_cast<int64_t>(c10::elementSize(dtype_)),
                                     kept_ ? kept_->pool() : nullptr);
  }

  // On the CPU, requests of up to this many query (and key) rows share packed projection GEMMs.
  // Larger ones already fill a GEMM well, so packing would only add copies: they run alone,
  // straight into their responses (bench/RESULTS.md has the measurements behind the number). On
  // CUDA every call packs (EngineOptions::pack_rows).
  static constexpr int64_t kCpuPackRows = 128;

  std::vector<Status> ForwardBatch(const std::vector<const AttendCall*>& calls,
                                   const std::vector<AttendOutputs*>& outs,
                                   const Parallel& parallel) const override {
    std::vector<Status> statuses(calls.size());
    // On CUDA the batch is timed with events on the worker's stream (the metrics' compute time is
    // then GPU time, not the host's wait for it).
    std::optional<DeviceTimer> timer;
    const Status timing = Guarded([&] { timer.emplace(device_.is_cuda()); });
    StageClock clock{timer ? &*timer : nullptr};
    std::vector<const AttendCall*> small_calls;
    std::vector<AttendOutputs*> small_outs;
    std::vector<size_t> small_index;
    for (size_t i = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      // Small calls share the projection GEMMs: query rows, plus the key rows a call carries (a
      // memory's or session's kept keys are projected already). A memory's creation runs alone.
      // A decoder's calls too (each rotated and normed on its own rows after the shared GEMMs).
      if (c.kv_use != AttendCall::Kv::kCreateMemory &&
          c.batch * std::max(c.query_len, c.key ? c.key_len : 0) <= pack_rows_) {
        small_calls.push_back(&c);
        small_outs.push_back(outs[i]);
        small_index.push_back(i);
      } else {
        statuses[i] = ForwardOne(c, outs[i], parallel);
      }
    }
    // On CUDA a lone call packs too: its copies and answer take the batch's staged path.
    if (small_calls.size() == 1 && !device_.is_cuda()) {
      statuses[small_index[0]] = ForwardOne(*small_calls[0], small_outs[0], parallel);
    } else if (!small_calls.empty()) {
      const Status st = Guarded([&] { ForwardPacked(small_calls, small_outs, parallel, &clock); });
      for (size_t i : small_index) statuses[i] = st;
    }
    double device_seconds = -1;
    BatchStages stages;
    if (timing.ok() && timer) {
      Guarded([&] {
        device_seconds = timer->Seconds();
        stages.copy_in = timer->Between(kGathered, kCopiedIn);
        stages.compute = timer->Between(kCopiedIn, kComputed);
        stages.copy_out = timer->Between(kComputed, kCopiedOut);
      });
    }
    if (stages.copy_in >= 0) stages.gather = clock.gather;
    for (AttendOutputs* out : outs) {
      out->device_seconds = device_seconds;
      out->stages = stages;
    }
    return statuses;
  }

 private:
  // One call, its pieces on `parallel`'s threads.
  Status ForwardOne(const AttendCall& call, AttendOutputs* out, const Parallel& parallel) const {
    return Guarded([&] {
      if (call.kv_use == AttendCall::Kv::kCreateMemory) return CreateMemory(call, parallel);
      const Rows r = Project(call, parallel);
      Attended a = AttendAny(call, r, at::Tensor(), out, parallel);
      WriteOutput(call, a, at::Tensor(), out, parallel);
    });
  }

  using Rows = QkvRows;

  template <typename F>
  Status Guarded(F&& f) const {
    try {
      c10::InferenceMode guard;
      WorkerStream stream(device_);
      f();
      return Status::Ok();
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      if (compat::IsOutOfMemory(e)) {
        // Give the cached blocks back so the next batches can fit; this batch is refused.
        ReleaseCachedDeviceMemory();
        return Status(StatusCode::kResourceExhausted, "device out of memory: " + what);
      }
      return Internal("engine: " + what);
    } catch (const std::exception& e) {
      return Internal(std::string("engine: ") + e.what());
    }
  }

  Rows Project(const AttendCall& call, const Parallel& parallel) const {
    const at::Tensor q_in = transfer_.InputRows(call.query);
    if (call.kv_use == AttendCall::Kv::kMemory)
      return Rotated(call, {products_.Linear(q_in, proj_.q, parallel), at::Tensor(), at::Tensor()});
    if (call.self_attention() && proj_.fused_in) {
      auto qkv = products_.Linear(q_in, proj_.in, parallel)
                     .split_with_sizes({spec_.q_width(), spec_.kv_width(), spec_.kv_width()}, -1);
      return Rotated(call, {qkv[0], qkv[1], qkv[2]});
    }
    const at::Tensor k_in = call.self_attention() ? q_in : transfer_.InputRows(*call.key);
    const at::Tensor v_in = call.self_attention() ? q_in : transfer_.InputRows(*call.value);
    return Rotated(
        call, {products_.Linear(q_in, proj_.q, parallel), products_.Linear(k_in, proj_.k, parallel),
               products_.Linear(v_in, proj_.v, parallel)});
  }

  // Each of `len` tokens' position in the wire's row order ([B*len] int64 on the device): the
  // call's own positions when `own` and it has them, else start, start + 1, ... per sequence, made
  // on the device itself (a decoding step's positions cost no copy from the host).
  at::Tensor RowPositions(const AttendCall& call, int64_t len, int64_t start, bool own) const {
    const int64_t b = call.batch;
    at::Tensor pos;  // [B, len]
    if (own && !call.positions.empty()) {
      pos = LongsOnDevice(call.positions, device_).view({b, len});
    } else {
      pos = at::arange(start, start + len, at::TensorOptions().dtype(at::kLong).device(device_))
                .expand({b, len});
    }
    if (!call.batch_first()) pos = pos.t();
    return pos.reshape({-1});
  }

  // A decoder's projected queries and keys as its attention takes them: each head RMS-normed
  // (q/k norm), then rotated by its token's position (RoPE). Keys of a session step and of
  // self-attention are at their queries' positions; cross-attention's at key_position onwards.
  Rows Rotated(const AttendCall& call, Rows r) const {
    if (!spec_.decoder) return r;
    const int64_t d = spec_.head_dim();
    const double eps = decoder_.eps;
    const int64_t q_start =
        call.query_position.value_or(call.kv_use == AttendCall::Kv::kSession ? call.kv_length : 0);
    // One rotation table for the queries and, at the same positions (self-attention, a session's
    // step), the keys.
    Rotation q_rot, k_rot;
    if (decoder_.inv_freq.defined()) {
      const at::ScalarType dt = r.q.scalar_type();
      q_rot = RotationAt(RowPositions(call, call.query_len, q_start, true), decoder_.inv_freq, dt);
      // (q, k and v come from the same products, in one dtype.)
      if (r.k.defined()) {
        k_rot = call.self_attention()
                    ? q_rot
                    : RotationAt(RowPositions(call, call.key_len, call.key_position, false),
                                 decoder_.inv_freq, dt);
      }
    }
    NormRotateInPlace(r.q.view({r.q.size(0), -1, d}), decoder_.q_norm, eps, q_rot);
    if (r.k.defined())
      NormRotateInPlace(r.k.view({r.k.size(0), -1, d}), decoder_.k_norm, eps, k_rot);
    return r;
  }

  // Packs every call's rows into one matrix per projection (no padding rows; PlanPacking says
  // where), runs attention over views of them, projects all outputs in one GEMM and splits the rows
  // into responses. Each of the plan's varlen runs attends in one launch; the others per call.
  void ForwardPacked(const std::vector<const AttendCall*>& calls,
                     const std::vector<AttendOutputs*>& outs, const Parallel& parallel,
                     StageClock* clock) const {
    const int64_t e = spec_.embed_dim, qw = spec_.q_width(), kvw = spec_.kv_width();
    const auto opts = at::TensorOptions().device(device_).dtype(dtype_);
    // A decoder's grouped heads and rotations are not in the varlen kernels: its calls attend
    // one by one after the shared projections.
    const PackingPlan plan =
        PlanPacking(calls, varlen_ != VarlenMode::kOff && !spec_.decoder, spec_.extra_keys());
    const std::vector<int64_t>& q_off = plan.q_offset;
    const std::vector<int64_t>& k_off = plan.k_offset;
    const int64_t q_rows = plan.q_rows, self_rows = plan.self_rows, k_rows = plan.k_rows;
    const PackedRows in = transfer_.Pack(calls, plan, e, spec_.kdim, spec_.vdim, clock);
    const at::Tensor &x = in.x, &kx = in.kx, &vx = in.vx;
    std::vector<at::Tensor> qkv_self;
    if (self_rows)
      qkv_self = products_.Linear(x.narrow(0, 0, self_rows), proj_.in, parallel)
                     .split_with_sizes({qw, kvw, kvw}, -1);
    at::Tensor q_cross, k_cross, v_cross;
    if (self_rows < q_rows) {
      q_cross = products_.Linear(x.narrow(0, self_rows, q_rows - self_rows), proj_.q, parallel);
      if (k_rows) {
        k_cross = products_.Linear(kx, proj_.k, parallel);
        v_cross = products_.Linear(vx, proj_.v, parallel);
      }
    }
    // Projected rows from call i's on: rq query rows, rk key and value rows ([rows, width] each).
    const auto rows_of = [&](size_t i, int64_t rq, int64_t rk) {
      if (calls[i]->self_attention()) {
        return Rows{qkv_self[0].narrow(0, q_off[i], rq), qkv_self[1].narrow(0, q_off[i], rq),
                    qkv_self[2].narrow(0, q_off[i], rq)};
      }
      if (!calls[i]->key)
        return Rows{q_cross.narrow(0, q_off[i] - self_rows, rq), at::Tensor(), at::Tensor()};
      return Rows{q_cross.narrow(0, q_off[i] - self_rows, rq), k_cross.narrow(0, k_off[i], rk),
                  v_cross.narrow(0, k_off[i], rk)};
    };
    at::Tensor merged = at::empty({q_rows, qw}, opts);
    std::vector<Attended> attended(calls.size());
    std::vector<bool> done(calls.size(), false);
    for (const std::vector<size_t>& run : plan.varlen_runs) {
      if (const char* backend = AttendVarlen(calls, run, rows_of, merged, q_off, spec_.num_heads,
                                             spec_.head_dim(), varlen_, products_)) {
        for (size_t i : run) {
          attended[i].backend = backend;
          done[i] = true;
        }
      }
    }
    if (kept_ && self_rows) kept_->Attend(calls, qkv_self, merged, q_off, &attended, &done);
    // Each call attends on one thread; the calls spread over the idle cores.
    const std::vector<size_t> pending = LongestFirst(calls, done);
    const size_t pieces = products_.Width(parallel) > 1 ? pending.size() : 1;
    products_.Pieces(parallel, static_cast<int64_t>(pieces), [&](int64_t piece) {
      const size_t from = pieces > 1 ? static_cast<size_t>(piece) : 0,
                   to = pieces > 1 ? from + 1 : pending.size();
      for (size_t at = from; at < to; ++at) {
        const size_t i = pending[at];
        const AttendCall& c = *calls[i];
        // A session step's rows: its new tokens' q, k and v (self-attention rows).
        const int64_t rk = c.kv_use == AttendCall::Kv::kSession ? c.query_len : c.key_len;
        // A decoder's rows are normed and rotated in place, each call's at its positions.
        const Rows r = Rotated(c, rows_of(i, c.batch * c.query_len, c.batch * rk));
        attended[i] = AttendAny(c, r, merged.narrow(0, q_off[i], c.batch * c.query_len), outs[i],
                                SerialParallel());
      }
    });
    at::Tensor y = at::empty({q_rows, e}, opts);
    products_.GemmInto(y, merged, proj_.out, parallel);
    clock->Mark(kComputed);
    if (device_.is_cuda() && transfer_.AnswersToStaging(calls, attended, y, q_off, outs, *clock))
      return;
    for (size_t i = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      WriteOutput(c, attended[i], y.narrow(0, q_off[i], c.batch * c.query_len), outs[i],
                  SerialParallel());
    }
  }

  // The calls not `done`, the longest attention first (pieces are taken in order): the cores then
  // finish together, not with a long session's attention alone on one core at the end (a batched
  // step's sessions over 1,024..4,096 keys, in the order a runner sends them).
  static std::vector<size_t> LongestFirst(const std::vector<const AttendCall*>& calls,
                                          const std::vector<bool>& done) {
    std::vector<size_t> pending;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (!done[i]) pending.push_back(i);
    }
    std::stable_sort(pending.begin(), pending.end(), [&](size_t a, size_t b) {
      return calls[a]->attention_cost > calls[b]->attention_cost;
    });
    return pending;
  }

  // [B*L, H*D] rows in the wire's order -> [B, H, L, D] (a view); H is the rows' heads (the
  // key/value heads for keys and values).
  at::Tensor SplitHeads(const at::Tensor& x, bool batch_first, int64_t b, int64_t len) const {
    const int64_t d = spec_.head_dim(), h = x.size(-1) / d;
    return batch_first ? x.view({b, len, h, d}).transpose(1, 2)
                       : x.view({len, b, h, d}).permute({1, 2, 0, 3});
  }

  // Attention of one call over its projected rows. The merged heads go to `dst` ([B*Lq, E] rows in
  // the wire's order) when it is defined, else to Attended::merged. Requested attention weights are
  // written block by block straight into `out`'s weights buffer, in the query's dtype.
  Attended AttendRows(const AttendCall& call, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& dst, AttendOutputs* out,
                      const Parallel& parallel) const {
    const bool batch_first = call.batch_first();
    const int64_t b = call.batch, lk = call.key_len;
    const at::Tensor kpm =
        call.key_padding_mask
            ? AdditiveMask(Wrap(*call.key_padding_mask), device_, score_dtype_).view({b, 1, 1, lk})
            : at::Tensor();
    return heads_->Attend(call, SplitHeads(q, batch_first, b, call.query_len),
                          {SplitHeads(k, batch_first, b, lk)}, {SplitHeads(v, batch_first, b, lk)},
                          kpm, 0, dst, out, parallel);
  }

  // Attention of a call whatever its keys: its own (rows r), a memory's, or a session's.
  Attended AttendAny(const AttendCall& call, const Rows& r, const at::Tensor& dst,
                     AttendOutputs* out, const Parallel& parallel) const {
    const bool batch_first = call.batch_first();
    const int64_t b = call.batch, lq = call.query_len;
    if (call.kv_use == AttendCall::Kv::kMemory) {
      TorchKv::Window m = static_cast<const TorchKv&>(*call.kv).Memory();
      return heads_->Attend(call, SplitHeads(r.q, batch_first, b, lq), std::move(m.k),
                            std::move(m.v), m.kpm, 0, dst, out, parallel);
    }
    if (call.kv_use == AttendCall::Kv::kSession) return AttendSession(call, r, dst, out, parallel);
    return AttendRows(call, r.q, r.k, r.v, dst, out, parallel);
  }

  // A memory's keys and values: projected once, heads split, kept contiguous.
  void CreateMemory(const AttendCall& call, const Parallel& parallel) const {
    TorchKv& m = static_cast<TorchKv&>(*call.kv);
    const bool batch_first = call.batch_first();
    const int64_t b = call.batch, lk = call.key_len;
    at::Tensor keys = products_.Linear(transfer_.InputRows(*call.key), proj_.k, parallel);
    if (spec_.decoder) {  // Kept normed and rotated, at key_position onwards.
      const int64_t d = spec_.head_dim();
      const at::Tensor heads = keys.view({keys.size(0), -1, d});
      Rotation rot;
      if (decoder_.inv_freq.defined())
        rot = RotationAt(RowPositions(call, lk, call.key_position, false), decoder_.inv_freq,
                         heads.scalar_type());
      NormRotateInPlace(heads, decoder_.k_norm, decoder_.eps, rot);
    }
    m.KeepKeys(SplitHeads(keys, batch_first, b, lk));
    m.KeepValues(SplitHeads(products_.Linear(transfer_.InputRows(*call.value), proj_.v, parallel),
                            batch_first, b, lk));
    if (call.key_padding_mask)
      m.KeepPadding(AdditiveMask(Wrap(*call.key_padding_mask), device_, score_dtype_)
                        .reshape({b, lk})
                        .to(dtype_));
  }

  // One session step: the new tokens' keys and values go after the L the session holds, then the
  // new queries attend causally over all L + T.
  Attended AttendSession(const AttendCall& call, const Rows& r, const at::Tensor& dst,
                         AttendOutputs* out, const Parallel& parallel) const {
    const bool batch_first = call.batch_first();
    const int64_t b = call.batch, t = call.query_len, held = call.kv_length;
    const at::Tensor kpm =
        call.key_padding_mask
            ? AdditiveMask(Wrap(*call.key_padding_mask), device_, score_dtype_).view({b, t})
            : at::Tensor();
    TorchKv::Window all = static_cast<TorchKv&>(*call.kv).Append(
        held, call.kv_capacity, SplitHeads(r.k, batch_first, b, t),
        SplitHeads(r.v, batch_first, b, t), kpm);
    return heads_->Attend(call, SplitHeads(r.q, batch_first, b, t), std::move(all.k),
                          std::move(all.v), all.kpm, held, dst, out, parallel);
  }

  // Writes one call's output into its response bytes (AttendHeads wrote the weights). `y` holds the
  // projected rows when the caller projected a whole batch; otherwise the projection writes
  // straight into the response.
  void WriteOutput(const AttendCall& call, const Attended& a, const at::Tensor& y,
                   AttendOutputs* out, const Parallel& parallel) const {
    const int64_t b = call.batch, lq = call.query_len, e = spec_.embed_dim;
    const DType out_dtype = call.query.dtype;
    out->attention_backend = a.backend;
    out->output->resize(static_cast<size_t>(b * lq * e) * DTypeSize(out_dtype));
    at::Tensor dst = at::from_blob(out->output->data(), {b * lq, e}, ToScalarType(out_dtype));
    if (y.defined()) {
      dst.copy_(y);
    } else if (device_.is_cpu() && (dst.scalar_type() == dtype_ || proj_.out.packed)) {
      // Straight into the response (oneDNN writes float32 answers from bfloat16 rows itself).
      products_.GemmInto(dst, a.merged, proj_.out, parallel);
    } else {
      at::Tensor projected = at::empty({b * lq, e}, a.merged.options());
      products_.GemmInto(projected, a.merged, proj_.out, parallel);
      dst.copy_(projected);
    }
    if (a.dead.defined()) dst.masked_fill_(a.dead, 0);
  }

  ModelSpec spec_;
  // Calls of up to this many rows per projection pack into the batch's shared GEMMs.
  int64_t pack_rows_;
  at::Device device_;
  at::ScalarType dtype_;
  // Attention scores' dtype: float32 on the CPU whatever dtype_ (scores, masks and softmax from
  // the products' float32 accumulators); dtype_ on CUDA (its fused kernels take masks in it).
  at::ScalarType score_dtype_;
  KernelChoice choice_;
  BatchTransfer transfer_;
  Products products_;
  Projections proj_;
  VarlenMode varlen_;
  // A decoder's q/k norms and rotation (all undefined for other models).
  DecoderHeads decoder_;
  std::unique_ptr<HeadAttention> heads_;
  // Sessions' kept runs and the pool their blocks lie in (null: each block its own).
  std::unique_ptr<KeptRuns> kept_;
};

}  // namespace

StatusOr<std::unique_ptr<AttentionModel>> CreateTorchModel(const ModelWeights& weights,
                                                           const EngineOptions& options) {
  const auto fail = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  ConfigureBlas();
  // LibTorch's own intra-op threads (OpenMP; MKL's follow them) default to every core, on top of
  // the server's one compute thread per core: each op would fan out and oversubscribe the cores.
  // Parallelism is the server's (one worker per core, idle ones helping a batch: parallel.h).
  static std::once_flag one_thread;
  std::call_once(one_thread, [] { at::set_num_threads(1); });
  try {
    at::Device device(options.device);
    if (device.is_cuda()) {
      const int n = at::detail::getCUDAHooks().getNumGPUs();
      if (!at::hasCUDA() || n == 0) {
        return fail("--device " + options.device + ": CUDA is not available (" +
                    EngineDescription() + "); use --device cpu");
      }
      if (device.has_index() && device.index() >= n) {
        return fail("--device " + options.device + ": only " + std::to_string(n) +
                    " CUDA device(s)");
      }
    } else if (!device.is_cpu()) {
      return fail("--device " + options.device + ": expected cpu, cuda or cuda:N");
    }
    if (device.is_cpu() && options.compute_dtype == DType::kFloat16) {
      // Measured (one core, linear 512 -> 1536): LibTorch 1.13 has no float16 matrix product on
      // the CPU, 2.11 runs one at ~10 GFLOP/s against ~100-200 in bfloat16.
      return fail(
          "--dtype float16: not on the CPU (no fast float16 matrix product there); use "
          "--dtype bfloat16, or float32 (the default, exact)");
    }
    if (!device.is_cuda() && options.allow_tf32) return fail("--tf32: needs a CUDA device");
    if (device.is_cuda()) {
      at::globalContext().setAllowTF32CuBLAS(options.allow_tf32);
#if TORCH_VERSION_MAJOR >= 2
      compat::AvoidRuntimeCompiledAttention();
#endif
    }
    std::shared_ptr<HostStaging> staging = options.staging;
    if (device.is_cuda() && !staging)
      staging = std::make_shared<HostStaging>(EngineOptions::kDefaultStagingBytes, true);
    c10::InferenceMode guard;
    auto model = std::make_unique<TorchModel>(
        weights, device, options.compute_dtype, options.varlen, options.min_piece_flops,
        options.force_float32_bfloat16_products, options.pack_rows, std::move(staging),
        options.kv_pool_chunk_bytes, options.kv_pool_max_bytes);
    return std::unique_ptr<AttentionModel>(std::move(model));
  } catch (const c10::Error& e) {
    return fail("--device " + options.device + ": " + e.what_without_backtrace());
  }
}

bool EngineHasFusedAttention() { return compat::kHasFusedSdpa; }

std::string EngineCpuClass() { return onednn::CpuClass(); }

std::string EngineOnednnDescription() { return onednn::Describe(); }

std::string EngineDescription() {
  return std::string("LibTorch ") + TORCH_VERSION +
         (at::hasCUDA()     ? " (CUDA)"
          : BuiltWithCuda() ? " (built with CUDA, no GPU seen)"
                            : " (CPU)");
}

}  // namespace attnserve
