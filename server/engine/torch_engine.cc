// The LibTorch model: nn.MultiheadAttention's computation over request bytes, composed of the
// products (products.h), attention over heads (head_attention.h) and kept keys and values
// (torch_kv.h); projections, packing of small calls into shared GEMMs, varlen attention and the
// answers' bytes are here. LibTorch is seen by the engine's translation units only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "server/core/checked_math.h"
#include "server/core/packing_plan.h"
#include "server/engine/attention_model.h"
#include "server/engine/blas.h"
#include "server/engine/device_support.h"
#include "server/engine/head_attention.h"
#include "server/engine/kept_attention.h"
#include "server/engine/onednn.h"
#include "server/engine/panel_gemm.h"
#include "server/engine/products.h"
#include "server/engine/rotary.h"
#include "server/engine/small_attention.h"
#include "server/engine/torch_compat.h"
#include "server/engine/torch_kv.h"
#include "server/engine/torch_tensors.h"

namespace attnserve {
namespace {

// Whether LibTorch's bfloat16 matrix products accumulate in float32 on this CPU. oneDNN's do (CPUs
// with AVX-512); LibTorch 1.13's own kernels, its fallback elsewhere, add each product into the
// bfloat16 result: off by 1.9e-2 of the scale at 64 terms, 4.5e-2 at 512, 1.2e-1 at 2048 (AMD EPYC
// with AVX2 only). Checked once, on the products the engine runs: sums of 1,024 ones are 1,024 in
// float32 and stop at 256 in bfloat16 (8 significant bits).
bool CpuBfloat16ProductsAccumulateInFloat32() {
  static const bool yes = [] {
    c10::InferenceMode guard;
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
    const at::Tensor a = at::ones({16, 1024}, bf16), b = at::ones({1024, 16}, bf16);
    const at::Tensor bt = at::ones({16, 1024}, bf16).t();  // the same values, transposed in memory
    const at::Tensor products[] = {
        at::mm(a, b),
        at::mm(a, bt),
        at::addmm(at::zeros({16}, bf16), a, b),
        at::matmul(a.view({2, 8, 1024}), b.view({1, 1024, 16}).expand({2, 1024, 16})),
        at::matmul(a.view({2, 8, 1024}), bt.unsqueeze(0).expand({2, 1024, 16})),
        at::linear(a, at::ones({16, 1024}, bf16))};
    for (const at::Tensor& p : products) {
      if (!p.to(at::kFloat).eq(1024).all().item<bool>()) return false;
    }
    return true;
  }();
  return yes;
}

// Whether this CPU multiplies bfloat16 natively (AVX512-BF16; CPUs with AMX have it too). Without
// it LibTorch's bfloat16 products either add in bfloat16 (1.13, above) or run many times slower
// than float32 (2.11 on an AMD EPYC with AVX2: the service's W1 3,190 tokens/s in bfloat16 against
// 42,446 in float32), so the engine multiplies in float32 there.
// As oneDNN dispatches (ONEDNN_MAX_CPU_ISA may cap it below the CPU: LibTorch's own bfloat16
// products then throw).
bool CpuHasBfloat16Products() { return onednn::HasBfloat16Kernels(); }

class TorchModel final : public AttentionModel {
 public:
  TorchModel(const ModelWeights& w, at::Device device, DType dtype, EngineOptions::Varlen varlen,
             double min_piece_flops, bool force_widen, int64_t pack_rows,
             std::shared_ptr<HostStaging> staging, int64_t kv_pool_chunk_bytes,
             int64_t kv_pool_max_bytes)
      : spec_(w.spec),
        staging_(std::move(staging)),
        pack_rows_(pack_rows > 0      ? pack_rows
                   : device.is_cuda() ? std::numeric_limits<int64_t>::max()
                                      : kCpuPackRows),
        device_(device),
        dtype_(ToScalarType(dtype)),
        score_dtype_(device.is_cpu() ? at::kFloat : dtype_),
        min_piece_flops_(min_piece_flops),
        widen_(WidensBfloat16(dtype_, device, force_widen)),
        products_(device, dtype_, min_piece_flops, widen_,
                  small_packed_ ? Products::kSmallPackedRows : 0),
        varlen_(varlen == EngineOptions::Varlen::kEmulate ? Varlen::kEmulate
                : varlen == EngineOptions::Varlen::kAuto && device.is_cuda() && compat::kHasVarlen
                    ? Varlen::kKernel
                    : Varlen::kOff) {
    spec_.device = device.str();
    spec_.compute_dtype = dtype;
    const int64_t e = spec_.embed_dim, wq = spec_.q_width(), wkv = spec_.kv_width();
    // Projection weights in float32 when bfloat16 products are widened (no widening per call).
    const auto opts = at::TensorOptions().device(device).dtype(widen_ ? at::kFloat : dtype_);
    packed_ = spec_.kdim == e && spec_.vdim == e;
    if (packed_) {
      // One [3E, E] matrix: self-attention projects q, k and v in a single matmul; q, k and v
      // are its row blocks.
      proj_in_.w =
          at::cat({FromHost(w.q_proj, opts), FromHost(w.k_proj, opts), FromHost(w.v_proj, opts)});
      proj_q_.w = proj_in_.w.narrow(0, 0, wq);
      proj_k_.w = proj_in_.w.narrow(0, wq, wkv);
      proj_v_.w = proj_in_.w.narrow(0, wq + wkv, wkv);
    } else {
      proj_q_.w = FromHost(w.q_proj, opts);
      proj_k_.w = FromHost(w.k_proj, opts);
      proj_v_.w = FromHost(w.v_proj, opts);
    }
    if (w.in_proj_bias) {
      proj_in_.b = FromHost(*w.in_proj_bias, opts);
      proj_q_.b = proj_in_.b.narrow(0, 0, wq);
      proj_k_.b = proj_in_.b.narrow(0, wq, wkv);
      proj_v_.b = proj_in_.b.narrow(0, wq + wkv, wkv);
    }
    // out_proj.weight transposed and contiguous ([in, out], what the BLAS reads), viewed as [out,
    // in].
    proj_out_.w = FromHost(w.out_proj, opts).t().contiguous().t();
    if (w.out_proj_bias) proj_out_.b = FromHost(*w.out_proj_bias, opts);
    if (device.is_cpu()) PackWeights(w);
    const HeadAttentionOptions heads = HeadOptions(w, opts);
    heads_ = std::make_unique<HeadAttention>(heads, products_);
    spec_.kernels = Kernels();
    SetUpKeptRuns(heads, kv_pool_chunk_bytes, kv_pool_max_bytes);
  }

  // Sessions' kept keys and values in a KvPool, and their steps attending in kept runs
  // (AttendKeptRuns), where a kernel takes this model's attention: flash attention's (half
  // precision, head_dim a multiple of 8 up to 256) or the memory-efficient kernel's (ungrouped,
  // no window); every model under kEmulate. Not with bias_k/bias_v or add_zero_attn (keys of
  // their own beside the kept ones).
  void SetUpKeptRuns(const HeadAttentionOptions& heads, int64_t chunk_bytes, int64_t max_bytes) {
    const int64_t kvh = spec_.kv_heads(), d = spec_.head_dim();
    kept_scale_ = heads.scale > 0 ? heads.scale : 1.0 / std::sqrt(static_cast<double>(d));
    kept_window_ = heads.window;
    const bool half = dtype_ == at::kHalf || dtype_ == at::kBFloat16;
    const bool kernel = varlen_ == Varlen::kKernel && ((half && d % 8 == 0 && d <= 256) ||
                                                       (kvh == spec_.num_heads && !heads.window));
    if (spec_.extra_keys() > 0 || !(kernel || varlen_ == Varlen::kEmulate)) return;
    if (chunk_bytes <= 0)
      chunk_bytes = device_.is_cuda() ? kCudaPoolChunkBytes : kCpuPoolChunkBytes;
    const int64_t row = 2 * kvh * d * static_cast<int64_t>(c10::elementSize(dtype_));
    kv_pool_ = std::make_shared<KvPool>(kvh, d, at::TensorOptions().device(device_).dtype(dtype_),
                                        std::max<int64_t>(1, chunk_bytes / row),
                                        max_bytes > 0 ? std::max<int64_t>(1, max_bytes / row) : 0);
  }
  static constexpr int64_t kCudaPoolChunkBytes = int64_t{1} << 30;
  static constexpr int64_t kCpuPoolChunkBytes = int64_t{16} << 20;

  // How its attention over heads computes (and, in small_products_, whether a grouped layer's
  // decoding steps run on small_attention's kernels). `opts`: the projection weights' options.
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
    heads.device = device_;
    heads.score_dtype = score_dtype_;
    heads.widen = widen_;
    // LibTorch's fused kernel (2.x). Not for CPU bfloat16: the oneDNN math path (float32 scores)
    // was faster than 2.11's CPU flash kernel at every shape measured (in-process W1 302k against
    // 264k tokens/s, W2 347k against 206k, a lone [1, 1024, 512] request 8.4 against 16.9 ms;
    // bench/RESULTS.md), and as accurate.
    // Grouped heads too, a group's query rows as one head's (HeadAttention::RunBlock): on the
    // math path an H200 stepped a grouped layer 0.90x as fast as an ungrouped one (RESULTS.md).
    heads.fused =
        compat::kHasFusedSdpa && !(device_.is_cpu() && dtype_ == at::kBFloat16) && heads.scale == 0;
    // float32 attention products through oneDNN on every CPU it has kernels for: LibTorch's float32
    // bmm calls the BLAS, at half oneDNN's speed on the AVX-512 EPYC measured, and slower on the
    // AVX2 EPYC too (1.1-1.3x on prefill shapes; a one-token step over 1,100 keys in 32 heads 1.9
    // ms against 0.6).
    heads.onednn_float32 = onednn_float32_ || small_packed_;
    // A grouped layer's decoding step (a group's G query heads as the rows of one key/value head)
    // through small_attention's kernels, which read each kept key and value once from its row:
    // [4, 8, 64] over 1,121 cold keys, scores 0.14 ms and values 0.15 against oneDNN's 0.24 and
    // 0.19 on the AVX2 EPYC; [4, 8, 64] over 1,100 cold keys on the AVX-512 EPYC (Zen 5), scores
    // 0.024 ms and values 0.037 (the AVX-512 kernels) against oneDNN's AVX-512 0.077-0.092 and
    // 0.060-0.066 (the grouped layer's decoding steps +10%). Grouped models only: a plain model's
    // attention stays bit for bit what it was (its short prefills, the kernels' other shapes,
    // measured even). Not where the fused kernel runs (LibTorch 2.x: unchanged, not measured
    // against them), and in float32 only (widened bfloat16 too).
    small_products_ = device_.is_cpu() && !heads.fused && spec_.kv_heads() < spec_.num_heads &&
                      (dtype_ == at::kFloat || widen_) && kernels_ != small_attention::Isa::kNone;
    heads.small_products = small_products_;
    const bool cpu_bfloat16 = device_.is_cpu() && dtype_ == at::kBFloat16 && !widen_;
    // The softmax on the engine's own kernel (AVX-512, or AVX2's eight lanes) for a grouped
    // layer's float32 decoding steps (small products) and CPU bfloat16 (its float32 scores,
    // bfloat16 probabilities): W2 bfloat16 on the AMX Xeon's engine bench 13.9 -> 10.8 ms a batch.
    // Plain float32 models keep LibTorch's softmax (their answers bit for bit what they were).
    heads.own_softmax = small_products_ || cpu_bfloat16;
    // CPU bfloat16 attention on dense copies of its operands where oneDNN's kernels take no other
    // (AMX; onednn::WantsDenseOperands).
    heads.dense_products = cpu_bfloat16 && onednn::WantsDenseOperands();
    heads.kernels = kernels_;
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
    if (w.q_norm) q_norm_ = FromHost(*w.q_norm, opts.dtype(dtype_));
    if (w.k_norm) k_norm_ = FromHost(*w.k_norm, opts.dtype(dtype_));
    if (dec.rotary) inv_freq_ = RotaryInverseFrequencies(*dec.rotary).to(device_);
  }

  // Whether bfloat16 products are widened to float32: CPU bfloat16 where the CPU has no bfloat16
  // products, or LibTorch's add in bfloat16 (or when forced, for tests).
  static bool WidensBfloat16(at::ScalarType dtype, at::Device device, bool force) {
    return dtype == at::kBFloat16 && device.is_cpu() &&
           (force || !CpuHasBfloat16Products() || !CpuBfloat16ProductsAccumulateInFloat32());
  }

  const ModelSpec& spec() const override { return spec_; }

  // Which kernels compute this model (ModelSpec::kernels).
  std::string Kernels() const {
    if (device_.is_cuda()) return "LibTorch CUDA";
    std::string s;
    if (proj_out_.panels) {
      s = "float32 projections on AVX2 kernels over weights in panels of " +
          std::to_string(panel_gemm::Panels::kColumns) + " columns, LibTorch's other products";
    } else if (proj_out_.packed && small_packed_) {
      s = "LibTorch float32 products (BLAS); up to " + std::to_string(Products::kSmallPackedRows) +
          " rows oneDNN float32 on packed weights (" + proj_out_.packed->Layout() + ")";
    } else if (proj_out_.packed) {
      s = std::string("oneDNN ") + (dtype_ == at::kBFloat16 ? "bfloat16" : "float32") +
          " on packed weights (" + proj_out_.packed->Layout() + ")";
    } else if (widen_) {
      s = "float32 products rounded to bfloat16 (no bfloat16 products here)";
    } else {
      s = std::string("LibTorch ") + c10::toString(dtype_) + " products (BLAS)";
    }
    s += heads_->Fused(false) ? ", fused attention" : ", attention";
    if (dtype_ != at::kFloat) s += " with float32 scores";
    if (small_products_) {
      s += kernels_ == small_attention::Isa::kAvx512
               ? " (grouped decoding steps on AVX2 and AVX-512 kernels)"
               : " (grouped decoding steps on AVX2 kernels)";
    }
    return s;
  }

  // The projections' weights packed once for oneDNN's kernels (onednn.h): bfloat16 on every CPU
  // that multiplies it (the products' own kernels), float32 where oneDNN's AVX-512 kernels beat
  // the BLAS, and elsewhere (small_packed_: the input projection, or q, k and v when there is
  // none, and the output projection) in panel_gemm's panels where the CPU runs them (AVX2: every
  // product), else in oneDNN's layout for small batches only.
  // A projection packed neither way keeps LibTorch's products.
  void PackWeights(const ModelWeights& w) {
    const bool all =
        (dtype_ == at::kBFloat16 && !widen_) || (dtype_ == at::kFloat && onednn_float32_);
    if (!all && !small_packed_) return;
    const onednn::Type type =
        dtype_ == at::kBFloat16 ? onednn::Type::kBFloat16 : onednn::Type::kFloat32;
    const bool panels = !all && panel_gemm::Available();
    const auto pack = [type, panels](Proj* proj, const HostTensor& weight,
                                     const std::optional<HostTensor>& bias, int64_t bias_offset) {
      const float* b = bias ? bias->values.data() + bias_offset : nullptr;
      if (panels) {
        proj->panels =
            panel_gemm::Panels::Make(weight.values.data(), b, weight.shape[0], weight.shape[1]);
      } else {
        proj->packed = onednn::PackedLinear::Make(weight.values.data(), b, weight.shape[0],
                                                  weight.shape[1], type);
      }
    };
    const int64_t e = spec_.embed_dim, wq = spec_.q_width(), wkv = spec_.kv_width();
    if (all || !packed_) {
      pack(&proj_q_, w.q_proj, w.in_proj_bias, 0);
      pack(&proj_k_, w.k_proj, w.in_proj_bias, wq);
      pack(&proj_v_, w.v_proj, w.in_proj_bias, wq + wkv);
    }
    pack(&proj_out_, w.out_proj, w.out_proj_bias, 0);
    if (packed_) {
      HostTensor in;
      in.shape = {wq + 2 * wkv, e};
      for (const HostTensor* part : {&w.q_proj, &w.k_proj, &w.v_proj})
        in.values.insert(in.values.end(), part->values.begin(), part->values.end());
      pack(&proj_in_, in, w.in_proj_bias, 0);
    }
  }

  Status Forward(const AttendCall& call, AttendOutputs* out) const override {
    return ForwardOne(call, out, SerialParallel());
  }

  std::shared_ptr<KvCache> NewKvCache() const override {
    return std::make_shared<TorchKv>(spec_.kv_width(),
                                     static_cast<int64_t>(c10::elementSize(dtype_)), kv_pool_);
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
  // Points of a batch's work on the device that DeviceTimer marks (BatchStages: the intervals).
  enum Mark { kGathered = 0, kCopiedIn = 1, kComputed = 2, kCopiedOut = 3 };
  // Where a packed batch's time goes: the device's marks, and the host's gather into staging.
  struct StageClock {
    DeviceTimer* device = nullptr;
    double gather = -1;
    void Mark(Mark m) const {
      if (device) device->Mark(m);
    }
  };

  // One call, its pieces on `parallel`'s threads.
  Status ForwardOne(const AttendCall& call, AttendOutputs* out, const Parallel& parallel) const {
    return Guarded([&] {
      if (call.kv_use == AttendCall::Kv::kCreateMemory) return CreateMemory(call, parallel);
      const Rows r = Project(call, parallel);
      Attended a = AttendAny(call, r, at::Tensor(), out, parallel);
      WriteOutput(call, a, at::Tensor(), out, parallel);
    });
  }

  // One call's projected rows, in the wire's row order: q [B*Lq, E], k and v [B*Lk, E].
  struct Rows {
    at::Tensor q, k, v;
  };

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

  // The wire bytes as [rows, features] on the compute device: no copy on CPU in float32; on CUDA
  // through a pinned staging buffer (LibTorch's caching host allocator) and a non-blocking copy on
  // the worker's stream.
  at::Tensor InputRows(const TensorView& v) const {
    const at::Tensor host = Wrap(v).view({-1, v.shape.back()});
    if (!device_.is_cuda()) {
      // Float32 rows for a bfloat16 model rounded by the AVX-512 kernel where there is one, as
      // LibTorch rounds them, in one pass from the wire's bytes.
      if (dtype_ == at::kBFloat16 && host.scalar_type() == at::kFloat && host.is_contiguous()) {
        at::Tensor rows = at::empty(host.sizes(), host.options().dtype(at::kBFloat16));
        if (small_attention::ToBfloat16(host.data_ptr<float>(), host.numel(),
                                        reinterpret_cast<uint16_t*>(rows.data_ptr()), kernels_))
          return rows;
      }
      return host.to(dtype_);
    }
    at::Tensor pinned = at::empty(host.sizes(), host.options().pinned_memory(true));
    pinned.copy_(host);
    return pinned.to(device_, dtype_, /*non_blocking=*/true);
  }

  Rows Project(const AttendCall& call, const Parallel& parallel) const {
    const at::Tensor q_in = InputRows(call.query);
    if (call.kv_use == AttendCall::Kv::kMemory)
      return Rotated(call, {products_.Linear(q_in, proj_q_, parallel), at::Tensor(), at::Tensor()});
    if (call.self_attention() && packed_) {
      auto qkv = products_.Linear(q_in, proj_in_, parallel)
                     .split_with_sizes({spec_.q_width(), spec_.kv_width(), spec_.kv_width()}, -1);
      return Rotated(call, {qkv[0], qkv[1], qkv[2]});
    }
    const at::Tensor k_in = call.self_attention() ? q_in : InputRows(*call.key);
    const at::Tensor v_in = call.self_attention() ? q_in : InputRows(*call.value);
    return Rotated(
        call, {products_.Linear(q_in, proj_q_, parallel), products_.Linear(k_in, proj_k_, parallel),
               products_.Linear(v_in, proj_v_, parallel)});
  }

  // Each of `len` tokens' position in the wire's row order ([B*len] int64 on the device): the
  // call's own positions when `own` and it has them, else start, start + 1, ... per sequence, made
  // on the device itself (a decoding step's positions cost no copy from the host).
  at::Tensor RowPositions(const AttendCall& call, int64_t len, int64_t start, bool own) const {
    const int64_t b = call.batch;
    at::Tensor pos;  // [B, len]
    if (own && !call.positions.empty()) {
      pos = LongsOnDevice(call.positions).view({b, len});
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
    const double eps = spec_.decoder->rms_norm_eps;
    const int64_t q_start =
        call.query_position.value_or(call.kv_use == AttendCall::Kv::kSession ? call.kv_length : 0);
    // One rotation table for the queries and, at the same positions (self-attention, a session's
    // step), the keys.
    Rotation q_rot, k_rot;
    if (inv_freq_.defined()) {
      const at::ScalarType dt = r.q.scalar_type();
      q_rot = RotationAt(RowPositions(call, call.query_len, q_start, true), inv_freq_, dt);
      // (q, k and v come from the same products, in one dtype.)
      if (r.k.defined()) {
        k_rot = call.self_attention()
                    ? q_rot
                    : RotationAt(RowPositions(call, call.key_len, call.key_position, false),
                                 inv_freq_, dt);
      }
    }
    const auto transform = [&](at::Tensor& x, const at::Tensor& norm, const Rotation& rot) {
      at::Tensor heads = x.view({x.size(0), -1, d});
      if (norm.defined()) RmsNormHeadsInPlace(heads, norm, eps);
      if (rot.cos.defined()) RotateInPlace(heads, rot);
    };
    transform(r.q, q_norm_, q_rot);
    if (r.k.defined()) transform(r.k, k_norm_, k_rot);
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
        PlanPacking(calls, varlen_ != Varlen::kOff && !spec_.decoder, spec_.extra_keys());
    const std::vector<int64_t>& q_off = plan.q_offset;
    const std::vector<int64_t>& k_off = plan.k_offset;
    const int64_t q_rows = plan.q_rows, self_rows = plan.self_rows, k_rows = plan.k_rows;
    const Packed in = Pack(calls, plan, clock);
    const at::Tensor &x = in.x, &kx = in.kx, &vx = in.vx;
    std::vector<at::Tensor> qkv_self;
    if (self_rows)
      qkv_self = products_.Linear(x.narrow(0, 0, self_rows), proj_in_, parallel)
                     .split_with_sizes({qw, kvw, kvw}, -1);
    at::Tensor q_cross, k_cross, v_cross;
    if (self_rows < q_rows) {
      q_cross = products_.Linear(x.narrow(0, self_rows, q_rows - self_rows), proj_q_, parallel);
      if (k_rows) {
        k_cross = products_.Linear(kx, proj_k_, parallel);
        v_cross = products_.Linear(vx, proj_v_, parallel);
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
      if (const char* backend = AttendVarlen(calls, run, rows_of, merged, q_off)) {
        for (size_t i : run) {
          attended[i].backend = backend;
          done[i] = true;
        }
      }
    }
    if (kv_pool_ && self_rows) AttendKeptRuns(calls, qkv_self, merged, q_off, &attended, &done);
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
    products_.GemmInto(y, merged, proj_out_, parallel);
    clock->Mark(kComputed);
    if (device_.is_cuda() && AnswersToStaging(calls, attended, y, q_off, outs, *clock)) return;
    for (size_t i = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      WriteOutput(c, attended[i], y.narrow(0, q_off[i], c.batch * c.query_len), outs[i],
                  SerialParallel());
    }
  }

  // Whether a call's step can attend in a kept run: a session step asking for no weights, with no
  // mask of its own (its session never had key padding: TorchKv::Placed), each sequence's tokens
  // consecutive in its rows.
  static bool KeptRunTakes(const AttendCall& c) {
    return c.kv_use == AttendCall::Kv::kSession && c.is_causal && !c.key_padding_mask &&
           !c.attn_mask && c.weights == WeightsMode::kNone &&
           (c.batch_first() || c.batch == 1 || c.query_len == 1);
  }

  // The session steps whose kept rows lie in one pool slot, grouped by chunk: each group's new keys
  // and values are written where they go, and its queries attend in one launch (AttendKept). The
  // others (forks reading shared blocks, key padding, masks, weights) attend per call after.
  void AttendKeptRuns(const std::vector<const AttendCall*>& calls,
                      const std::vector<at::Tensor>& qkv, const at::Tensor& merged,
                      const std::vector<int64_t>& q_off, std::vector<Attended>* attended,
                      std::vector<bool>* done) const {
    std::map<const KvPool::Chunk*, KeptRun> runs;
    for (size_t i = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      if ((*done)[i] || !KeptRunTakes(c)) continue;
      auto& kv = static_cast<TorchKv&>(*c.kv);
      kv.Prepare(c.kv_length, c.kv_capacity, c.batch, spec_.kv_heads(), c.query_len,
                 spec_.head_dim(), /*padded_step=*/false, qkv[1].options());
      if (std::optional<TorchKv::Placement> at = kv.Placed()) {
        KeptRun& run = runs[at->chunk.get()];
        run.chunk = at->chunk;
        run.steps.emplace_back(i, *at);
      }
    }
    for (const auto& [chunk, run] : runs) {
      if (const char* backend = AttendKeptRun(calls, run, qkv, merged, q_off)) {
        for (const auto& [i, at] : run.steps) {
          (*attended)[i].backend = backend;
          (*done)[i] = true;
        }
      }
    }
  }

  // One chunk's steps: calls[i] with its placement.
  struct KeptRun {
    std::shared_ptr<KvPool::Chunk> chunk;
    std::vector<std::pair<size_t, TorchKv::Placement>> steps;
  };

  // A kept run: its rows gathered from the batch's projections (q, k, v: [self rows, width]),
  // normed and rotated at once, the new keys and values written to their rows of the chunk, the
  // attention merged back into the batch's rows. Null (nothing written to `merged`; the calls
  // then attend one by one, their rows rewritten in place) when no kernel takes it.
  const char* AttendKeptRun(const std::vector<const AttendCall*>& calls, const KeptRun& run,
                            const std::vector<at::Tensor>& qkv, const at::Tensor& merged,
                            const std::vector<int64_t>& q_off) const {
    const int64_t h = spec_.num_heads, kvh = spec_.kv_heads(), d = spec_.head_dim();
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
    const at::Tensor index = LongsOnDevice(rows);
    const at::Tensor in = index.narrow(0, 0, n);
    at::Tensor q = qkv[0].index_select(0, in).view({n, h, d});
    const at::Tensor k = qkv[1].index_select(0, in).view({n, kvh, d});
    const at::Tensor v = qkv[2].index_select(0, in).view({n, kvh, d});
    if (spec_.decoder) {
      const double eps = spec_.decoder->rms_norm_eps;
      if (q_norm_.defined()) RmsNormHeadsInPlace(q, q_norm_, eps);
      if (k_norm_.defined()) RmsNormHeadsInPlace(k, k_norm_, eps);
      if (inv_freq_.defined()) {
        const Rotation rot = RotationAt(index.narrow(0, 2 * n, n), inv_freq_, q.scalar_type());
        RotateInPlace(q, rot);
        RotateInPlace(k, rot);
      }
    }
    run.chunk->k.index_copy_(0, index.narrow(0, n, n), k);
    run.chunk->v.index_copy_(0, index.narrow(0, n, n), v);
    try {
      const KeptAttended a =
          AttendKept(q, *run.chunk, seqs, kept_scale_, kept_window_, varlen_ == Varlen::kEmulate);
      merged.index_copy_(0, in, a.out.reshape({n, h * d}).to(merged.scalar_type()));
      return a.backend;
    } catch (const c10::Error& e) {
      if (compat::IsOutOfMemory(e)) throw;
      return nullptr;
    }
  }

  // Host int64s on the model's device (CUDA: through pinned memory, without waiting).
  at::Tensor LongsOnDevice(const std::vector<int64_t>& values) const {
    const at::Tensor host = at::from_blob(const_cast<int64_t*>(values.data()),
                                          {static_cast<int64_t>(values.size())}, at::kLong);
    if (!device_.is_cuda()) return host.clone();
    at::Tensor pinned = at::empty(host.sizes(), host.options().pinned_memory(true));
    pinned.copy_(host);
    return pinned.to(device_, at::kLong, /*non_blocking=*/true);
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

  // A batch's wire rows in the compute dtype, packed as its plan says: every query row in x, the
  // key and value rows that came on the wire in kx and vx; `held` keeps the host block they were
  // staged in until its copy to the device is done.
  struct Packed {
    at::Tensor x, kx, vx;
    std::vector<std::shared_ptr<void>> held;
  };
  Packed Pack(const std::vector<const AttendCall*>& calls, const PackingPlan& plan,
              StageClock* clock) const {
    const int64_t e = spec_.embed_dim;
    const auto opts = at::TensorOptions().device(device_).dtype(dtype_);
    Packed p;
    p.x = at::empty({plan.q_rows, e}, opts);
    if (plan.k_rows) {
      p.kx = at::empty({plan.k_rows, spec_.kdim}, opts);
      p.vx = at::empty({plan.k_rows, spec_.vdim}, opts);
    }
    const std::vector<at::Tensor> wire = WireTensors(calls, &p.held, clock);
    for (size_t i = 0, t = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      p.x.narrow(0, plan.q_offset[i], c.batch * c.query_len).copy_(wire[t++].view({-1, e}));
      if (c.key) {
        const int64_t at = plan.k_offset[i], rows = c.batch * c.key_len;
        p.kx.narrow(0, at, rows).copy_(wire[t++].view({-1, spec_.kdim}));
        p.vx.narrow(0, at, rows).copy_(wire[t++].view({-1, spec_.vdim}));
      }
    }
    return p;
  }

  // The batch's query, key and value tensors in call order (query, then key and value where the
  // call has them), shaped as on the wire, in the wire's dtype. On the CPU: the request bytes,
  // uncopied. On CUDA: one device buffer filled by one host-to-device copy of a pinned staging
  // block the bytes are gathered into (or, when every tensor already lies in pinned memory, one
  // asynchronous copy each, no gathering); without room in the staging, a plain copy each.
  std::vector<at::Tensor> WireTensors(const std::vector<const AttendCall*>& calls,
                                      std::vector<std::shared_ptr<void>>* held,
                                      StageClock* clock) const {
    std::vector<const TensorView*> views;
    for (const AttendCall* c : calls) {
      views.push_back(&c->query);
      if (c->key) {
        views.push_back(&*c->key);
        views.push_back(&*c->value);
      }
    }
    std::vector<at::Tensor> out;
    if (!device_.is_cuda()) {
      for (const TensorView* v : views) out.push_back(Wrap(*v));
      return out;
    }
    std::vector<int64_t> offset;
    int64_t total = 0;
    bool all_pinned = true;
    for (const TensorView* v : views) {
      offset.push_back(total);
      total += static_cast<int64_t>((v->nbytes + 63) / 64 * 64);  // Aligned for any dtype.
      all_pinned = all_pinned && v->pinned;
    }
    const at::Tensor device_bytes =
        at::empty({total}, at::TensorOptions().device(device_).dtype(at::kByte));
    const auto host = [](const void* p, int64_t n) {
      return at::from_blob(const_cast<void*>(p), {n}, at::TensorOptions().dtype(at::kByte));
    };
    char* block = nullptr;
    std::shared_ptr<void> staged;
    if (!all_pinned) staged = staging_->Allocate(static_cast<size_t>(total), &block);
    if (staged) {
      const auto gather_start = std::chrono::steady_clock::now();
      for (size_t i = 0; i < views.size(); ++i)
        std::memcpy(block + offset[i], views[i]->data, views[i]->nbytes);
      clock->gather =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - gather_start).count();
      clock->Mark(kGathered);
      device_bytes.copy_(host(block, total), /*non_blocking=*/true);
      held->push_back(std::move(staged));
    } else {
      if (all_pinned) clock->gather = 0;
      clock->Mark(kGathered);
      for (size_t i = 0; i < views.size(); ++i) {
        const int64_t n = static_cast<int64_t>(views[i]->nbytes);
        device_bytes.narrow(0, offset[i], n).copy_(host(views[i]->data, n), all_pinned);
      }
    }
    clock->Mark(kCopiedIn);
    for (size_t i = 0; i < views.size(); ++i) {
      const int64_t n = static_cast<int64_t>(views[i]->nbytes);
      out.push_back(device_bytes.narrow(0, offset[i], n)
                        .view(ToScalarType(views[i]->dtype))
                        .view(views[i]->shape));
    }
    return out;
  }

  // CUDA: the batch's answers, converted to the wire's dtype on the device, copied back in one
  // asynchronous copy into a pinned staging block that each call's answer then points into
  // (AttendOutputs::output_block: sent from there, no further copy). False when the staging has no
  // room (the caller writes each answer into its response instead) or a call wants weights.
  bool AnswersToStaging(const std::vector<const AttendCall*>& calls,
                        const std::vector<Attended>& attended, const at::Tensor& y,
                        const std::vector<int64_t>& q_off, const std::vector<AttendOutputs*>& outs,
                        const StageClock& clock) const {
    const DType wire = calls[0]->query.dtype;  // One wire dtype per batch (the batcher's rule).
    for (const AttendCall* c : calls) {
      if (c->query.dtype != wire || c->weights != WeightsMode::kNone) return false;
    }
    const int64_t e = spec_.embed_dim, rows = y.size(0);
    const size_t row_bytes = static_cast<size_t>(e) * DTypeSize(wire);
    char* block = nullptr;
    std::shared_ptr<void> staged =
        staging_->Allocate(static_cast<size_t>(rows) * row_bytes, &block);
    if (!staged) return false;
    at::Tensor answers = y.to(ToScalarType(wire));
    for (size_t i = 0; i < calls.size(); ++i) {
      if (attended[i].dead.defined())
        answers.narrow(0, q_off[i], calls[i]->batch * calls[i]->query_len)
            .masked_fill_(attended[i].dead.to(device_), 0);  // Dead rows are found on the host.
    }
    at::from_blob(block, {rows, e}, at::TensorOptions().dtype(ToScalarType(wire)))
        .copy_(answers, /*non_blocking=*/true);
    clock.Mark(kCopiedOut);
    // The copy is on this worker's stream: wait for it (and only it) before the answers go out.
    c10::impl::VirtualGuardImpl(device_.type()).getStream(device_).synchronize();
    std::shared_ptr<const void> owner = std::move(staged);
    for (size_t i = 0; i < calls.size(); ++i) {
      const size_t rows_i = static_cast<size_t>(calls[i]->batch * calls[i]->query_len);
      outs[i]->output_block = {owner, block + static_cast<size_t>(q_off[i]) * row_bytes,
                               rows_i * row_bytes};
      outs[i]->attention_backend = attended[i].backend;
    }
    return true;
  }

  // One varlen attention over a group's calls (same kind: self or cross, causal or not; eligible;
  // consecutive in the packed rows), every batch element a sequence; the heads go straight into
  // `merged`'s rows. Returns the kernel's name, or nullptr when the kernel refused the inputs (the
  // calls then attend one by one).
  template <typename RowsOf>
  const char* AttendVarlen(const std::vector<const AttendCall*>& calls,
                           const std::vector<size_t>& group, const RowsOf& rows_of,
                           const at::Tensor& merged, const std::vector<int64_t>& q_off) const {
    const int64_t h = spec_.num_heads, d = spec_.head_dim();
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
    const Rows rows = rows_of(group[0], total_q, total_k);
    const at::Tensor q = rows.q.view({total_q, h, d});
    const at::Tensor k = rows.k.view({total_k, h, d});
    const at::Tensor v = rows.v.view({total_k, h, d});
    const at::Tensor dst = merged.narrow(0, q_off[group[0]], total_q).view({total_q, h, d});
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    if (varlen_ == Varlen::kEmulate) {
      AttendBySequence(q, k, v, cu_q, cu_k, causal, scale, dst);
      return "varlen_emulated";
    }
    try {
      const auto to_device = [&](const std::vector<int32_t>& cu) {
        return at::from_blob(const_cast<int32_t*>(cu.data()), {static_cast<int64_t>(cu.size())},
                             at::kInt)
            .to(device_, /*non_blocking=*/false, /*copy=*/true);
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

  // The varlen computation by plain per-sequence attention, on any device (EngineOptions::
  // Varlen::kEmulate): what the CPU tests run to check the packing around the kernel.
  void AttendBySequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                        bool causal, double scale, const at::Tensor& dst) const {
    for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
      const int64_t lq = cu_q[s + 1] - cu_q[s], lk = cu_k[s + 1] - cu_k[s];
      const at::Tensor qs = q.narrow(0, cu_q[s], lq).transpose(0, 1);  // [H, Lq, D]
      const at::Tensor ks = k.narrow(0, cu_k[s], lk).transpose(0, 1);
      const at::Tensor vs = v.narrow(0, cu_k[s], lk).transpose(0, 1);
      at::Tensor scores = products_.Matmul(qs * scale, ks.transpose(-2, -1));
      if (causal) {
        const at::Tensor upper =
            at::ones({lq, lk}, at::TensorOptions().dtype(at::kBool).device(device_)).triu(1);
        scores.masked_fill_(upper, -std::numeric_limits<double>::infinity());
      }
      dst.narrow(0, cu_q[s], lq)
          .copy_(products_.Matmul(at::softmax(scores, -1), vs).transpose(0, 1));
    }
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
    at::Tensor keys = products_.Linear(InputRows(*call.key), proj_k_, parallel);
    if (spec_.decoder) {  // Kept normed and rotated, at key_position onwards.
      const int64_t d = spec_.head_dim();
      at::Tensor heads = keys.view({keys.size(0), -1, d});
      if (k_norm_.defined()) RmsNormHeadsInPlace(heads, k_norm_, spec_.decoder->rms_norm_eps);
      if (inv_freq_.defined())
        RotateInPlace(heads, RotationAt(RowPositions(call, lk, call.key_position, false), inv_freq_,
                                        heads.scalar_type()));
    }
    m.KeepKeys(SplitHeads(keys, batch_first, b, lk));
    m.KeepValues(SplitHeads(products_.Linear(InputRows(*call.value), proj_v_, parallel),
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
    } else if (device_.is_cpu() && (dst.scalar_type() == dtype_ || proj_out_.packed)) {
      // Straight into the response (oneDNN writes float32 answers from bfloat16 rows itself).
      products_.GemmInto(dst, a.merged, proj_out_, parallel);
    } else {
      at::Tensor projected = at::empty({b * lq, e}, a.merged.options());
      products_.GemmInto(projected, a.merged, proj_out_, parallel);
      dst.copy_(projected);
    }
    if (a.dead.defined()) dst.masked_fill_(a.dead, 0);
  }

  ModelSpec spec_;
  // CUDA: pinned host memory for the batches' copies (null on the CPU).
  std::shared_ptr<HostStaging> staging_;
  // Calls of up to this many rows per projection pack into the batch's shared GEMMs.
  int64_t pack_rows_;
  at::Device device_;
  at::ScalarType dtype_;
  // Attention scores' dtype: float32 on the CPU whatever dtype_ (scores, masks and softmax from
  // the products' float32 accumulators); dtype_ on CUDA (its fused kernels take masks in it).
  at::ScalarType score_dtype_;
  // oneDNN's AVX-512 kernels run here: float32 products go to them (onednn::HasAvx512Kernels).
  bool onednn_float32_ = onednn::HasAvx512Kernels();
  // small_attention's kernels at oneDNN's instruction set, never above this CPU's best: one
  // ONEDNN_MAX_CPU_ISA caps both, so a CPU runs the engine as one of a lower class would.
  small_attention::Isa kernels_ =
      std::min(small_attention::Best(), onednn::HasAvx512Kernels() ? small_attention::Isa::kAvx512
                                                                   : small_attention::Isa::kAvx2);
  // Float32 on a CPU whose oneDNN kernels are not AVX-512, under OpenBLAS (measured against it;
  // MKL's small products were not): the projections on panel_gemm's panels at every height
  // (AVX2), or elsewhere up to Products::kSmallPackedRows rows on oneDNN's packed weights and the
  // BLAS for the rest; the projections' weights are packed (a second copy of them). Attention's
  // products go to oneDNN.
  bool small_packed_ =
      device_.is_cpu() && dtype_ == at::kFloat && !onednn_float32_ && ConfigureBlas().openblas;
  // A grouped layer's decoding steps attend on small_attention's kernels (HeadAttentionOptions).
  bool small_products_ = false;
  double min_piece_flops_;
  // CPU bfloat16 where LibTorch's bfloat16 products accumulate in bfloat16: projection weights are
  // kept in float32 and every matrix product runs in float32, its result rounded to bfloat16.
  bool widen_ = false;
  Products products_;
  bool packed_ = false;
  // The input projection ([3E, E], self-attention with kdim = vdim = E; undefined otherwise), q, k
  // and v (its row blocks, or three matrices), and the output projection. Biases undefined without.
  Proj proj_in_, proj_q_, proj_k_, proj_v_, proj_out_;
  // How packed calls attend: kKernel = LibTorch's varlen kernels (CUDA), kEmulate = the same
  // packing by per-sequence attention (tests), kOff = per call.
  enum class Varlen { kOff, kKernel, kEmulate };
  Varlen varlen_;
  std::unique_ptr<HeadAttention> heads_;
  // Sessions' blocks (null: each its own; SetUpKeptRuns), and their kept runs' scale and window.
  std::shared_ptr<KvPool> kv_pool_;
  double kept_scale_ = 0;
  int64_t kept_window_ = 0;
  // A decoder's q/k RMSNorm weights ([D], compute dtype) and RoPE's inverse frequencies ([D'/2],
  // float32); undefined when it has none.
  at::Tensor q_norm_, k_norm_, inv_freq_;
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
