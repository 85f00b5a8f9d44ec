// The LibTorch forward: nn.MultiheadAttention's computation over request bytes. The LibTorch
// translation units are this one, torch_kv.cc (kept keys and values) and, in CUDA builds,
// device_support_cuda.cc.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "server/core/checked_math.h"
#include "server/core/packing_plan.h"
#include "server/engine/attention_model.h"
#include "server/engine/blas.h"
#include "server/engine/device_support.h"
#include "server/engine/onednn.h"
#include "server/engine/torch_compat.h"
#include "server/engine/torch_kv.h"

namespace attnserve {
namespace {

at::ScalarType ToScalarType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kBool:
      return at::kByte;  // Wire bools are bytes: any non-zero is true.
  }
  return at::kFloat;
}

// A tensor over the request's bytes, without a copy. Wire bools become a real bool tensor.
at::Tensor Wrap(const TensorView& v) {
  at::Tensor t = at::from_blob(const_cast<void*>(v.data), v.shape,
                               at::TensorOptions().dtype(ToScalarType(v.dtype)));
  return v.dtype == DType::kBool ? t.ne(0) : t;
}

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

// On a CUDA device, makes a stream from LibTorch's pool current for this thread: each compute
// worker keeps its own stream, so workers overlap and a worker's synchronous copy back waits for
// its own stream only. Device-generic (c10), so it compiles in CPU builds, where it does nothing.
class WorkerStream {
 public:
  explicit WorkerStream(at::Device device) {
    if (!device.is_cuda()) return;
    thread_local c10::optional<c10::Stream> stream;
    if (!stream || stream->device() != device) {
      stream = c10::impl::getDeviceGuardImpl(device.type())->getStreamFromGlobalPool(device);
    }
    guard_.emplace(*stream);
  }

 private:
  c10::optional<c10::StreamGuard> guard_;
};

// A tensor's bytes, dims and strides as oneDNN reads them (float32 or bfloat16 tensors only).
onednn::View ViewOf(const at::Tensor& t) {
  return {t.data_ptr(),
          t.scalar_type() == at::kBFloat16 ? onednn::Type::kBFloat16 : onednn::Type::kFloat32,
          t.sizes().vec(), t.strides().vec()};
}

// One projection: y = x · wᵀ + b. w [out, in] and b [out] (undefined: no bias) as LibTorch
// tensors; `packed` (CPU bfloat16): the same weights reordered once into the layout oneDNN's
// matrix-unit kernels read, which the products use where it runs.
struct Proj {
  at::Tensor w, b;
  std::shared_ptr<const onednn::PackedLinear> packed;
};

at::Tensor FromHost(const HostTensor& h, const at::TensorOptions& opts) {
  return at::from_blob(const_cast<float*>(h.values.data()), h.shape, at::kFloat)
      .to(opts, /*non_blocking=*/false, /*copy=*/true);
}

class TorchModel final : public AttentionModel {
 public:
  TorchModel(const ModelWeights& w, at::Device device, DType dtype, EngineOptions::Varlen varlen,
             double min_piece_flops, bool force_widen)
      : spec_(w.spec),
        device_(device),
        dtype_(ToScalarType(dtype)),
        score_dtype_(device.is_cpu() ? at::kFloat : dtype_),
        min_piece_flops_(min_piece_flops),
        varlen_(varlen == EngineOptions::Varlen::kEmulate ? Varlen::kEmulate
                : varlen == EngineOptions::Varlen::kAuto && device.is_cuda() && compat::kHasVarlen
                    ? Varlen::kKernel
                    : Varlen::kOff) {
    spec_.device = device.str();
    spec_.compute_dtype = dtype;
    const int64_t e = spec_.embed_dim;
    widen_ =
        dtype_ == at::kBFloat16 && device.is_cpu() &&
        (force_widen || !CpuHasBfloat16Products() || !CpuBfloat16ProductsAccumulateInFloat32());
    // Projection weights in float32 when bfloat16 products are widened (no widening per call).
    const auto opts = at::TensorOptions().device(device).dtype(widen_ ? at::kFloat : dtype_);
    packed_ = spec_.kdim == e && spec_.vdim == e;
    if (packed_) {
      // One [3E, E] matrix: self-attention projects q, k and v in a single matmul; q, k and v
      // are its row blocks.
      proj_in_.w =
          at::cat({FromHost(w.q_proj, opts), FromHost(w.k_proj, opts), FromHost(w.v_proj, opts)});
      proj_q_.w = proj_in_.w.narrow(0, 0, e);
      proj_k_.w = proj_in_.w.narrow(0, e, e);
      proj_v_.w = proj_in_.w.narrow(0, 2 * e, e);
    } else {
      proj_q_.w = FromHost(w.q_proj, opts);
      proj_k_.w = FromHost(w.k_proj, opts);
      proj_v_.w = FromHost(w.v_proj, opts);
    }
    if (w.in_proj_bias) {
      proj_in_.b = FromHost(*w.in_proj_bias, opts);
      proj_q_.b = proj_in_.b.narrow(0, 0, e);
      proj_k_.b = proj_in_.b.narrow(0, e, e);
      proj_v_.b = proj_in_.b.narrow(0, 2 * e, e);
    }
    // out_proj.weight transposed and contiguous ([in, out], what the BLAS reads), viewed as [out,
    // in].
    proj_out_.w = FromHost(w.out_proj, opts).t().contiguous().t();
    if (w.out_proj_bias) proj_out_.b = FromHost(*w.out_proj_bias, opts);
    // Projection weights packed once for oneDNN: bfloat16 on every CPU that multiplies it (the
    // products' own kernels), float32 where oneDNN's AVX-512 kernels beat the BLAS.
    if (device.is_cpu() &&
        ((dtype_ == at::kBFloat16 && !widen_) || (dtype_ == at::kFloat && onednn_float32_)))
      PackWeights(w);
    spec_.kernels = Kernels();
    if (w.bias_k) {
      bias_k_ = FromHost(*w.bias_k, opts.dtype(dtype_));
      bias_v_ = FromHost(*w.bias_v, opts.dtype(dtype_));
    }
  }

  const ModelSpec& spec() const override { return spec_; }

  // Which kernels compute this model (ModelSpec::kernels).
  std::string Kernels() const {
    if (device_.is_cuda()) return "LibTorch CUDA";
    std::string s;
    if (proj_out_.packed) {
      s = std::string("oneDNN ") + (dtype_ == at::kBFloat16 ? "bfloat16" : "float32") +
          " on packed weights (" + proj_out_.packed->Layout() + ")";
    } else if (widen_) {
      s = "float32 products rounded to bfloat16 (no bfloat16 products here)";
    } else {
      s = std::string("LibTorch ") + c10::toString(dtype_) + " products (BLAS)";
    }
    s += FusedAttention(false) ? ", fused attention" : ", attention";
    if (dtype_ != at::kFloat) s += " with float32 scores";
    return s;
  }

  // The projections' weights packed once for oneDNN's bfloat16 kernels (onednn.h); a projection
  // oneDNN does not pack here keeps LibTorch's products.
  void PackWeights(const ModelWeights& w) {
    const onednn::Type type =
        dtype_ == at::kBFloat16 ? onednn::Type::kBFloat16 : onednn::Type::kFloat32;
    const auto pack = [type](const HostTensor& weight, const std::optional<HostTensor>& bias,
                             int64_t bias_offset) -> std::shared_ptr<const onednn::PackedLinear> {
      return onednn::PackedLinear::Make(weight.values.data(),
                                        bias ? bias->values.data() + bias_offset : nullptr,
                                        weight.shape[0], weight.shape[1], type);
    };
    const int64_t e = spec_.embed_dim;
    proj_q_.packed = pack(w.q_proj, w.in_proj_bias, 0);
    proj_k_.packed = pack(w.k_proj, w.in_proj_bias, e);
    proj_v_.packed = pack(w.v_proj, w.in_proj_bias, 2 * e);
    proj_out_.packed = pack(w.out_proj, w.out_proj_bias, 0);
    if (packed_) {
      HostTensor in;
      in.shape = {3 * e, e};
      for (const HostTensor* part : {&w.q_proj, &w.k_proj, &w.v_proj})
        in.values.insert(in.values.end(), part->values.begin(), part->values.end());
      proj_in_.packed = pack(in, w.in_proj_bias, 0);
    }
  }

  Status Forward(const AttendCall& call, AttendOutputs* out) const override {
    return ForwardOne(call, out, SerialParallel());
  }

  std::shared_ptr<KvCache> NewKvCache() const override {
    return std::make_shared<TorchKv>(spec_.embed_dim,
                                     static_cast<int64_t>(c10::elementSize(dtype_)));
  }

  // Requests of up to this many query (and key) rows share packed projection GEMMs. Larger ones
  // already fill a GEMM well, so packing would only add copies: they run alone, straight into
  // their responses (bench/RESULTS.md has the measurements behind the number).
  static constexpr int64_t kPackRows = 128;

  std::vector<Status> ForwardBatch(const std::vector<const AttendCall*>& calls,
                                   const std::vector<AttendOutputs*>& outs,
                                   const Parallel& parallel) const override {
    std::vector<Status> statuses(calls.size());
    // On CUDA the batch is timed with events on the worker's stream (the metrics' compute time is
    // then GPU time, not the host's wait for it).
    std::optional<DeviceTimer> timer;
    const Status timing = Guarded([&] { timer.emplace(device_.is_cuda()); });
    std::vector<const AttendCall*> small_calls;
    std::vector<AttendOutputs*> small_outs;
    std::vector<size_t> small_index;
    for (size_t i = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      // Small calls share the projection GEMMs: query rows, plus the key rows a call carries (a
      // memory's or session's kept keys are projected already). A memory's creation runs alone.
      if (c.kv_use != AttendCall::Kv::kCreateMemory &&
          c.batch * std::max(c.query_len, c.key ? c.key_len : 0) <= kPackRows) {
        small_calls.push_back(&c);
        small_outs.push_back(outs[i]);
        small_index.push_back(i);
      } else {
        statuses[i] = ForwardOne(c, outs[i], parallel);
      }
    }
    if (small_calls.size() == 1) {
      statuses[small_index[0]] = ForwardOne(*small_calls[0], small_outs[0], parallel);
    } else if (!small_calls.empty()) {
      const Status st = Guarded([&] { ForwardPacked(small_calls, small_outs, parallel); });
      for (size_t i : small_index) statuses[i] = st;
    }
    double device_seconds = -1;
    if (timing.ok() && timer) Guarded([&] { device_seconds = timer->Seconds(); });
    for (AttendOutputs* out : outs) out->device_seconds = device_seconds;
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

  // ---- pieces on several cores (server/engine/parallel.h) ---------------------------------------
  // A GEMM piece has at least 16 rows (the BLAS kernels' height), and every piece at least
  // EngineOptions::min_piece_flops of work.
  static constexpr int64_t kMinGemmRows = 16;

  // How many pieces of at least `min_rows` rows to cut `rows` rows into, each worth
  // `flops_per_row`.
  int64_t Blocks(const Parallel& parallel, int64_t rows, double flops_per_row,
                 int64_t min_rows) const {
    const int64_t width = Width(parallel);
    if (width <= 1) return 1;
    const auto by_flops =
        static_cast<int64_t>(std::ceil(min_piece_flops_ / std::max(flops_per_row, 1.0)));
    return std::max<int64_t>(1, std::min(width, rows / std::max(min_rows, by_flops)));
  }

  // Threads the work may be cut for: the idle cores on the CPU; one on a GPU (its kernels are
  // parallel already, and one stream per worker keeps their order).
  int64_t Width(const Parallel& parallel) const { return device_.is_cpu() ? parallel.Width() : 1; }

  // Runs fn(i) for i in [0, n) on `parallel`'s threads, each piece under its own inference mode
  // (it is thread-local); the first exception a piece throws comes back here once all have run.
  template <typename F>
  void Pieces(const Parallel& parallel, int64_t n, F&& fn) const {
    if (n <= 1) {
      if (n == 1) fn(0);
      return;
    }
    std::mutex mu;
    std::exception_ptr first;
    parallel.For(n, [&](int64_t i) {
      try {
        c10::InferenceMode guard;
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
    if (first) std::rethrow_exception(first);
  }

  // [start, size) of block i when `total` rows are cut into `blocks` nearly equal blocks.
  static std::pair<int64_t, int64_t> Block(int64_t total, int64_t blocks, int64_t i) {
    const int64_t base = total / blocks, extra = total % blocks;
    return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
  }

  // Up to this many rows, a float32 product on the CPU runs as one matrix-vector product per row:
  // an OpenBLAS GEMM call has a fixed cost (it packs the whole weight matrix and computes whole
  // micro-tiles), which a one-token decoding step would pay per projection: against [3E, E] at
  // E=512 here a 1-row GEMM took 0.30 ms, 4 rows 0.25, 16 rows 0.46, a GEMV 0.05 ms a row.
  static constexpr int64_t kGemvRows = 4;

  bool UseGemv(const at::Tensor& x, const at::Tensor& w) const {
    return device_.is_cpu() && x.size(0) <= kGemvRows && x.scalar_type() == at::kFloat &&
           w.scalar_type() == at::kFloat;
  }

  // y = x · wt (+ b) row by row as matrix-vector products (for UseGemv).
  void GemvInto(const at::Tensor& y, const at::Tensor& x, const at::Tensor& wt,
                const at::Tensor& b) const {
    const at::Tensor w = wt.t();  // [out, in]
    for (int64_t i = 0; i < x.size(0); ++i) {
      at::Tensor yi = y.select(0, i);
      if (b.defined()) {
        at::addmv_out(yi, b, w, x.select(0, i));
      } else {
        at::mv_out(yi, w, x.select(0, i));
      }
    }
  }

  // x [rows, in] · wt [in, out] (+ b) into y [rows, out], the rows cut into blocks, one GEMM each,
  // when cores are idle: every output row is computed as the single GEMM would.
  void GemmInto(const at::Tensor& y, const at::Tensor& x, const Proj& proj,
                const Parallel& parallel) const {
    const at::Tensor wt = proj.w.t();
    const at::Tensor& b = proj.b;
    if (UseGemv(x, wt) && y.scalar_type() == at::kFloat) {
      GemvInto(y, x, wt, b);
      return;
    }
    const int64_t blocks = Blocks(parallel, x.size(0), 2.0 * wt.size(0) * wt.size(1), kMinGemmRows);
    Pieces(parallel, blocks, [&](int64_t i) {
      const auto [r0, n] =
          blocks > 1 ? Block(x.size(0), blocks, i) : std::make_pair(int64_t{0}, x.size(0));
      at::Tensor yi = y.narrow(0, r0, n);
      if (RunPacked(proj, x.narrow(0, r0, n), yi)) return;
      if (x.scalar_type() != wt.scalar_type() || yi.scalar_type() != wt.scalar_type()) {
        // Widened (float32 weights, bfloat16 rows), or rows written in another dtype.
        const at::Tensor xi = x.narrow(0, r0, n).to(wt.scalar_type());
        yi.copy_(b.defined() ? at::addmm(b, xi, wt) : at::mm(xi, wt));
      } else if (b.defined()) {
        at::addmm_out(yi, b, x.narrow(0, r0, n), wt);
      } else {
        at::mm_out(yi, x.narrow(0, r0, n), wt);
      }
    });
  }

  // The product on the packed weights when oneDNN runs it: x [rows, in] and y [rows, out] with
  // unit column strides, x in the packed type, y in it or float32.
  bool RunPacked(const Proj& proj, const at::Tensor& x, const at::Tensor& y) const {
    if (!proj.packed || x.scalar_type() != dtype_ || x.stride(1) != 1 || y.stride(1) != 1 ||
        (y.scalar_type() != at::kBFloat16 && y.scalar_type() != at::kFloat))
      return false;
    return proj.packed->Run(
        x.data_ptr(), x.size(0), x.stride(0), y.data_ptr(),
        y.scalar_type() == at::kFloat ? onednn::Type::kFloat32 : onednn::Type::kBFloat16,
        y.stride(0));
  }

  // nn.functional.linear(x, w, b) (w [out, in]), split as GemmInto.
  at::Tensor Linear(const at::Tensor& x, const Proj& proj, const Parallel& parallel) const {
    const at::Tensor& w = proj.w;
    const at::Tensor& b = proj.b;
    if (UseGemv(x, w)) {
      at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
      GemvInto(y, x, w.t(), b);
      return y;
    }
    if (proj.packed) {
      at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
      GemmInto(y, x, proj, parallel);
      return y;
    }
    if (Blocks(parallel, x.size(0), 2.0 * w.size(0) * w.size(1), kMinGemmRows) <= 1) {
      return x.scalar_type() == w.scalar_type()
                 ? at::linear(x, w, b)
                 : at::linear(x.to(w.scalar_type()), w, b).to(x.scalar_type());
    }
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    GemmInto(y, x.contiguous(), proj, parallel);
    return y;
  }

  // a · b (batched as at::matmul), in float32 and rounded back when bfloat16 products are widened.
  at::Tensor Matmul(const at::Tensor& a, const at::Tensor& b) const {
    if (!widen_) return at::matmul(a, b);
    return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
  }

  // One call's projected rows, in the wire's row order: q [B*Lq, E], k and v [B*Lk, E].
  struct Rows {
    at::Tensor q, k, v;
  };
  // One call's attention result before the output projection.
  struct Attended {
    at::Tensor merged;  // [B*Lq, E] in the wire's row order (undefined when written to a dst)
    at::Tensor dead;    // [B*Lq, 1] bool: query masked in every head (undefined: none)
    const char* backend = "math";
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
    if (!device_.is_cuda()) return host.to(dtype_);
    at::Tensor pinned = at::empty(host.sizes(), host.options().pinned_memory(true));
    pinned.copy_(host);
    return pinned.to(device_, dtype_, /*non_blocking=*/true);
  }

  Rows Project(const AttendCall& call, const Parallel& parallel) const {
    const at::Tensor q_in = InputRows(call.query);
    if (call.kv_use == AttendCall::Kv::kMemory)
      return {Linear(q_in, proj_q_, parallel), at::Tensor(), at::Tensor()};
    if (call.self_attention() && packed_) {
      auto qkv = Linear(q_in, proj_in_, parallel).chunk(3, -1);
      return {qkv[0], qkv[1], qkv[2]};
    }
    const at::Tensor k_in = call.self_attention() ? q_in : InputRows(*call.key);
    const at::Tensor v_in = call.self_attention() ? q_in : InputRows(*call.value);
    return {Linear(q_in, proj_q_, parallel), Linear(k_in, proj_k_, parallel),
            Linear(v_in, proj_v_, parallel)};
  }

  // Packs every call's rows into one matrix per projection (no padding rows; PlanPacking says
  // where), runs attention over views of them, projects all outputs in one GEMM and splits the rows
  // into responses. Each of the plan's varlen runs attends in one launch; the others per call.
  void ForwardPacked(const std::vector<const AttendCall*>& calls,
                     const std::vector<AttendOutputs*>& outs, const Parallel& parallel) const {
    const int64_t e = spec_.embed_dim;
    const auto opts = at::TensorOptions().device(device_).dtype(dtype_);
    const PackingPlan plan = PlanPacking(calls, varlen_ != Varlen::kOff, spec_.extra_keys());
    const std::vector<int64_t>& q_off = plan.q_offset;
    const std::vector<int64_t>& k_off = plan.k_offset;
    const int64_t q_rows = plan.q_rows, self_rows = plan.self_rows, k_rows = plan.k_rows;
    at::Tensor x = at::empty({q_rows, e}, opts);
    at::Tensor kx = k_rows ? at::empty({k_rows, spec_.kdim}, opts) : at::Tensor();
    at::Tensor vx = k_rows ? at::empty({k_rows, spec_.vdim}, opts) : at::Tensor();
    for (size_t i = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      x.narrow(0, q_off[i], c.batch * c.query_len).copy_(Wrap(c.query).view({-1, e}));
      if (c.key) {
        kx.narrow(0, k_off[i], c.batch * c.key_len).copy_(Wrap(*c.key).view({-1, spec_.kdim}));
        vx.narrow(0, k_off[i], c.batch * c.key_len).copy_(Wrap(*c.value).view({-1, spec_.vdim}));
      }
    }
    std::vector<at::Tensor> qkv_self;
    if (self_rows) qkv_self = Linear(x.narrow(0, 0, self_rows), proj_in_, parallel).chunk(3, -1);
    at::Tensor q_cross, k_cross, v_cross;
    if (self_rows < q_rows) {
      q_cross = Linear(x.narrow(0, self_rows, q_rows - self_rows), proj_q_, parallel);
      if (k_rows) {
        k_cross = Linear(kx, proj_k_, parallel);
        v_cross = Linear(vx, proj_v_, parallel);
      }
    }
    // Projected rows from call i's on: rq query rows, rk key and value rows ([rows, E] each).
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
    at::Tensor merged = at::empty({q_rows, e}, opts);
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
    // Each call attends on one thread; the calls spread over the idle cores.
    std::vector<size_t> pending;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (!done[i]) pending.push_back(i);
    }
    const size_t pieces = Width(parallel) > 1 ? pending.size() : 1;
    Pieces(parallel, static_cast<int64_t>(pieces), [&](int64_t piece) {
      const size_t from = pieces > 1 ? static_cast<size_t>(piece) : 0,
                   to = pieces > 1 ? from + 1 : pending.size();
      for (size_t at = from; at < to; ++at) {
        const size_t i = pending[at];
        const AttendCall& c = *calls[i];
        // A session step's rows: its new tokens' q, k and v (self-attention rows).
        const int64_t rk = c.kv_use == AttendCall::Kv::kSession ? c.query_len : c.key_len;
        const Rows r = rows_of(i, c.batch * c.query_len, c.batch * rk);
        attended[i] = AttendAny(c, r, merged.narrow(0, q_off[i], c.batch * c.query_len), outs[i],
                                SerialParallel());
      }
    });
    at::Tensor y = at::empty({q_rows, e}, opts);
    GemmInto(y, merged, proj_out_, parallel);
    for (size_t i = 0; i < calls.size(); ++i) {
      const AttendCall& c = *calls[i];
      WriteOutput(c, attended[i], y.narrow(0, q_off[i], c.batch * c.query_len), outs[i],
                  SerialParallel());
    }
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
      at::Tensor scores = Matmul(qs * scale, ks.transpose(-2, -1));
      if (causal) {
        const at::Tensor upper =
            at::ones({lq, lk}, at::TensorOptions().dtype(at::kBool).device(device_)).triu(1);
        scores.masked_fill_(upper, -std::numeric_limits<double>::infinity());
      }
      dst.narrow(0, cu_q[s], lq).copy_(Matmul(at::softmax(scores, -1), vs).transpose(0, 1));
    }
  }

  // [B*L, E] rows in the wire's order -> [B, H, L, D] (a view).
  at::Tensor SplitHeads(const at::Tensor& x, bool batch_first, int64_t b, int64_t len) const {
    const int64_t h = spec_.num_heads, d = spec_.head_dim();
    return batch_first ? x.view({b, len, h, d}).transpose(1, 2)
                       : x.view({len, b, h, d}).permute({1, 2, 0, 3});
  }

  // A float mask (0 = attend, -inf = masked, else added) from a bool or float mask tensor.
  at::Tensor Additive(const at::Tensor& m) const {
    const at::Tensor d = m.to(device_);
    if (d.scalar_type() == at::kBool) {
      return at::zeros(d.sizes(), d.options().dtype(score_dtype_))
          .masked_fill_(d, -std::numeric_limits<double>::infinity());
    }
    return d.to(score_dtype_);
  }

  // Most attention scores one block of queries may hold at once (B·H·rows·S). Attention is
  // computed block by block over the queries, so a long request needs this much working memory
  // (scores, their softmax and the block's mask: ~3 x 8 MiB in float32) instead of three
  // [B, H, Lq, S] matrices (1.5 GiB for one [1, 4096, 512] request with 8 heads).
  static constexpr int64_t kBlockScores = int64_t{2} << 20;

  // Attention of one call over its projected rows. The merged heads go to `dst` ([B*Lq, E] rows in
  // the wire's order) when it is defined, else to Attended::merged. Requested attention weights are
  // written block by block straight into `out`'s weights buffer, in the query's dtype.
  Attended AttendRows(const AttendCall& call, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& dst, AttendOutputs* out,
                      const Parallel& parallel) const {
    const bool batch_first = call.batch_first();
    const int64_t b = call.batch, lk = call.key_len;
    const at::Tensor kpm = call.key_padding_mask
                               ? Additive(Wrap(*call.key_padding_mask)).view({b, 1, 1, lk})
                               : at::Tensor();
    return AttendHeads(call, SplitHeads(q, batch_first, b, call.query_len),
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
      return AttendHeads(call, SplitHeads(r.q, batch_first, b, lq), std::move(m.k), std::move(m.v),
                         m.kpm, 0, dst, out, parallel);
    }
    if (call.kv_use == AttendCall::Kv::kSession) return AttendSession(call, r, dst, out, parallel);
    return AttendRows(call, r.q, r.k, r.v, dst, out, parallel);
  }

  // A memory's keys and values: projected once, heads split, kept contiguous.
  void CreateMemory(const AttendCall& call, const Parallel& parallel) const {
    TorchKv& m = static_cast<TorchKv&>(*call.kv);
    const bool batch_first = call.batch_first();
    const int64_t b = call.batch, lk = call.key_len;
    m.KeepKeys(SplitHeads(Linear(InputRows(*call.key), proj_k_, parallel), batch_first, b, lk));
    m.KeepValues(SplitHeads(Linear(InputRows(*call.value), proj_v_, parallel), batch_first, b, lk));
    if (call.key_padding_mask)
      m.KeepPadding(Additive(Wrap(*call.key_padding_mask)).reshape({b, lk}).to(dtype_));
  }

  // One session step: the new tokens' keys and values go after the L the session holds, then the
  // new queries attend causally over all L + T.
  Attended AttendSession(const AttendCall& call, const Rows& r, const at::Tensor& dst,
                         AttendOutputs* out, const Parallel& parallel) const {
    const bool batch_first = call.batch_first();
    const int64_t b = call.batch, t = call.query_len, held = call.kv_length;
    const at::Tensor kpm =
        call.key_padding_mask ? Additive(Wrap(*call.key_padding_mask)).view({b, t}) : at::Tensor();
    TorchKv::Window all = static_cast<TorchKv&>(*call.kv).Append(
        held, call.kv_capacity, SplitHeads(r.k, batch_first, b, t),
        SplitHeads(r.v, batch_first, b, t), kpm);
    return AttendHeads(call, SplitHeads(r.q, batch_first, b, t), std::move(all.k), std::move(all.v),
                       all.kpm, held, dst, out, parallel);
  }

  // Whether attention's products on `t`'s dtype go to oneDNN: on the CPU in bfloat16, and in
  // float32 where oneDNN's AVX-512 kernels run (LibTorch's float32 bmm calls the BLAS, at half
  // their speed on the AVX-512 EPYC measured); oneDNN takes the strided heads as they lie.
  bool OnednnAttends(const at::Tensor& t) const {
    return device_.is_cpu() &&
           (t.scalar_type() == at::kBFloat16 || (t.scalar_type() == at::kFloat && onednn_float32_));
  }

  // Whether attention runs LibTorch's fused kernel (2.x; not when weights are asked for). Not for
  // CPU bfloat16: the oneDNN path below (float32 scores) was faster than 2.11's CPU flash kernel
  // at every shape measured (in-process W1 302k against 264k tokens/s, W2 347k against 206k, a lone
  // [1, 1024, 512] request 8.4 against 16.9 ms; bench/RESULTS.md), and as accurate.
  bool FusedAttention(bool want_weights) const {
    return compat::kHasFusedSdpa && !want_weights && !(device_.is_cpu() && dtype_ == at::kBFloat16);
  }

  // pp [H, n, S'] = scale · q [H, n, D] · kt [H, D, S'] (+ mask, broadcastable to pp). Scores wider
  // than the operands (float32 from bfloat16) come from oneDNN, which keeps its float32
  // accumulators (LibTorch's products would round them to bfloat16); the mask is then added in
  // float32.
  void ScoresInto(at::Tensor pp, const at::Tensor& q, const at::Tensor& kt, const at::Tensor& mask,
                  double scale) const {
    if (pp.scalar_type() == q.scalar_type() && !OnednnAttends(q)) {
      if (mask.defined()) {
        at::baddbmm_out(pp, mask, q, kt, /*beta=*/1, /*alpha=*/scale);
      } else {
        at::baddbmm_out(pp, pp, q, kt, /*beta=*/0, /*alpha=*/scale);
      }
      return;
    }
    if (!(device_.is_cpu() &&
          onednn::Matmul(ViewOf(q), ViewOf(kt), ViewOf(pp), static_cast<float>(scale)))) {
      at::bmm_out(pp, q.to(pp.scalar_type()), kt.to(pp.scalar_type()));
      pp.mul_(scale);
    }
    if (mask.defined()) pp.add_(mask);
  }

  // Attention over heads: qh [B, H, Lq, D]; keys and values [B, H, Lk, D] (Lk = call.key_len), as
  // consecutive pieces along the sequence (a session forked from another: its shared blocks, then
  // its own; else one piece); kpm additive and broadcastable to [B, 1, 1, Lk] (or undefined). A
  // causal query i may attend key j when j <= i + causal_offset (a session's queries come after the
  // keys it already held). Several pieces are attended where they lie (scores and products piece by
  // piece) on the float32/float16 math path; the widened and fused paths get them joined.
  Attended AttendHeads(const AttendCall& call, const at::Tensor& qh, std::vector<at::Tensor> ks,
                       std::vector<at::Tensor> vs, const at::Tensor& kpm, int64_t causal_offset,
                       const at::Tensor& dst, AttendOutputs* out, const Parallel& parallel) const {
    const int64_t b = call.batch, lq = call.query_len, lk = call.key_len;
    const int64_t e = spec_.embed_dim, h = spec_.num_heads, d = spec_.head_dim();
    const int64_t extra = spec_.extra_keys(), sl = lk + extra;
    const bool batch_first = call.batch_first();
    const bool want_weights = call.weights != WeightsMode::kNone;
    if (ks.size() > 1 && (widen_ || FusedAttention(want_weights))) {
      ks = {at::cat(ks, 2)};
      vs = {at::cat(vs, 2)};
    }

    // bias_k/bias_v, then the zero key/value, appended along the key sequence (as pieces of their
    // own when there are several).
    const auto append = [&](const at::Tensor& k, const at::Tensor& v) {
      if (ks.size() > 1) {
        ks.push_back(k);
        vs.push_back(v);
      } else {
        ks[0] = at::cat({ks[0], k}, 2);
        vs[0] = at::cat({vs[0], v}, 2);
      }
    };
    if (bias_k_.defined()) {
      append(bias_k_.view({1, h, 1, d}).expand({b, h, 1, d}),
             bias_v_.view({1, h, 1, d}).expand({b, h, 1, d}));
    }
    if (spec_.add_zero_attn) {
      append(at::zeros({b, h, 1, d}, qh.options()), at::zeros({b, h, 1, d}, qh.options()));
    }
    // Widened bfloat16 (CPUs whose bfloat16 products add in bfloat16): attention in float32.
    at::Tensor q_all = qh;
    if (widen_) {
      q_all = qh.to(at::kFloat);
      for (at::Tensor& k : ks) k = k.to(at::kFloat);
      for (at::Tensor& v : vs) v = v.to(at::kFloat);
    }
    const at::Tensor& kh = ks[0];
    const at::Tensor& vh = vs[0];

    // The masks stay in their wire form ([Lq, Lk] or [B, H, Lq, Lk], bool or float) and become
    // additive one query block at a time.
    at::Tensor attn_mask;
    if (call.attn_mask) {
      attn_mask = Wrap(*call.attn_mask);
      if (attn_mask.dim() == 3) attn_mask = attn_mask.view({b, h, lq, lk});
    }
    const bool fused = FusedAttention(want_weights) && ks.size() == 1;
    // Query blocks: bounded by kBlockScores, and with idle cores one per core (4 * B*H*S*D flops a
    // query row: QK^T and PV).
    const int64_t width = Blocks(parallel, lq, 4.0 * b * h * sl * d, 1);
    const int64_t rows = std::max<int64_t>(
        1,
        std::min({lq, kBlockScores / std::max<int64_t>(1, b * h * sl), (lq + width - 1) / width}));
    const int64_t blocks = (lq + rows - 1) / rows;
    // The fused kernel applies a plain causal mask by itself when the whole query is one block.
    const bool fused_causal = fused && call.is_causal && causal_offset == 0 &&
                              !attn_mask.defined() && !kpm.defined() && extra == 0 && rows == lq;

    at::Tensor weights_out;  // [B, H, Lq, S] or [B, Lq, S] over the answer's bytes
    if (want_weights) {
      const int64_t heads = call.weights == WeightsMode::kPerHead ? h : 1;
      out->weights->resize(static_cast<size_t>(b * heads * lq * sl) * DTypeSize(call.query.dtype));
      weights_out = at::from_blob(out->weights->data(), {b, heads, lq, sl},
                                  at::TensorOptions().dtype(ToScalarType(call.query.dtype)));
    }
    Attended result;
    at::Tensor merged = dst.defined() ? dst : at::empty({b * lq, e}, qh.options());
    // The merged rows as [B, H, Lq, D] (a view), whatever the wire layout.
    const at::Tensor merged_heads = batch_first ? merged.view({b, lq, h, d}).transpose(1, 2)
                                                : merged.view({lq, b, h, d}).permute({1, 2, 0, 3});
    // Per block, so that blocks can run on several threads: which kernel ran, and the block's
    // queries masked in every head ([B, n] bool; undefined: none).
    std::vector<const char*> backends(blocks, result.backend);
    std::vector<at::Tensor> dead_blocks(blocks);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const double ninf = -std::numeric_limits<double>::infinity();
    Pieces(parallel, blocks, [&](int64_t block) {
      const int64_t q0 = block * rows, n = std::min(rows, lq - q0);
      // One additive mask for the block, broadcastable to [B, H, n, S]; appended keys never masked.
      at::Tensor mask;
      // In the scores' dtype: a kept key padding is in the model's, the causal mask is made in it.
      auto add = [&mask, this](const at::Tensor& m) {
        const at::Tensor f = m.scalar_type() == score_dtype_ ? m : m.to(score_dtype_);
        mask = mask.defined() ? mask + f : f;
      };
      if (attn_mask.defined()) {
        const at::Tensor m = attn_mask.narrow(-2, q0, n);
        add(Additive(m.dim() == 2 ? m.view({1, 1, n, lk}) : m));
      }
      if (kpm.defined()) add(kpm);
      // Query q0 + i may attend key j only when j <= q0 + i + causal_offset. No key lies beyond the
      // block's first query (a one-token decoding step, the last row): nothing to mask.
      if (call.is_causal && !fused_causal && causal_offset + q0 + 1 < lk) {
        const at::Tensor upper =
            at::ones({n, lk}, at::TensorOptions().dtype(at::kBool).device(device_))
                .triu(causal_offset + q0 + 1);
        add(at::zeros({1, 1, n, lk}, qh.options()).masked_fill_(upper.view({1, 1, n, lk}), ninf));
      }
      if (mask.defined() && extra > 0) mask = at::constant_pad_nd(mask, {0, extra}, 0);

      // (head, query) rows whose every key is masked: PyTorch's softmax gives NaN there; we give 0.
      at::Tensor dead;
      bool any_dead = false;
      if (mask.defined()) {
        dead = mask.eq(ninf).all(-1, /*keepdim=*/true).expand({b, h, n, 1});
        any_dead = dead.any().item<bool>();
      }
      const at::Tensor qc = q_all.narrow(2, q0, n);
      at::Tensor attn;  // [B, H, n, D]
      if (fused) {
        backends[block] = compat::FusedSdpaBackend(qc, kh, vh, mask, fused_causal);
        attn = compat::FusedSdpa(qc, kh, vh, mask, fused_causal);
        if (any_dead) attn = attn.masked_fill(dead, 0);
      } else {
        // Per batch element, three products and no temporaries beyond the scores: scale·q·kᵀ plus
        // the mask, the softmax in place, p·v straight into the merged rows. The scores are in
        // score_dtype_: float32 for CPU bfloat16, from the products' float32 accumulators, so that
        // neither the mask nor the softmax sees bfloat16 rounding (a score of 50 rounds by 0.25).
        // Zeroed when LibTorch's baddbmm writes them with no mask to add: its small-matrix kernel
        // in 1.13 reads its input even with beta 0 (0 · NaN of uninitialised memory is NaN). Wider
        // scores come from oneDNN, which only writes.
        const auto score_opts = qc.options().dtype(score_dtype_);
        at::Tensor p = mask.defined() || score_dtype_ != qc.scalar_type() || OnednnAttends(qc)
                           ? at::empty({b, h, n, sl}, score_opts)
                           : at::zeros({b, h, n, sl}, score_opts);
        const at::Tensor block_heads = merged_heads.narrow(2, q0, n);
        for (int64_t bi = 0; bi < b; ++bi) {
          at::Tensor pb = p.select(0, bi);
          const at::Tensor mb = mask.defined()
                                    ? mask.select(0, mask.size(0) == 1 ? 0 : bi).expand({h, n, sl})
                                    : at::Tensor();
          int64_t off = 0;
          for (const at::Tensor& kp : ks) {  // The scores of each piece of keys, in place.
            const int64_t rows = kp.size(2);
            ScoresInto(ks.size() == 1 ? pb : pb.narrow(-1, off, rows), qc.select(0, bi),
                       kp.select(0, bi).transpose(-2, -1),
                       !mb.defined()    ? mb
                       : ks.size() == 1 ? mb
                                        : mb.narrow(-1, off, rows),
                       scale);
            off += rows;
          }
        }
        at::_softmax_out(p, p, -1, /*half_to_float=*/false);
        if (any_dead) p.masked_fill_(dead, 0);
        // p·v in the values' dtype (bfloat16 probabilities, as fused CPU kernels multiply them).
        const at::Tensor pv = p.scalar_type() == vh.scalar_type() ? p : p.to(vh.scalar_type());
        for (int64_t bi = 0; bi < b; ++bi) {
          at::Tensor out_b = block_heads.select(0, bi);
          // Widened: the float32 result, rounded into the merged rows.
          at::Tensor acc = out_b.scalar_type() == vh.scalar_type()
                               ? out_b
                               : at::empty(out_b.sizes(), out_b.options().dtype(vh.scalar_type()));
          const at::Tensor pb = pv.select(0, bi);
          // One piece of bfloat16 values on the CPU: oneDNN writes the strided merged rows itself
          // (LibTorch's bmm multiplies into a contiguous temporary and reorders it there).
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
        if (want_weights) {
          weights_out.narrow(2, q0, n).copy_(
              call.weights == WeightsMode::kAveraged ? p.mean(1, true) : p);
        }
      }
      if (attn.defined()) merged_heads.narrow(2, q0, n).copy_(attn);
      if (any_dead) dead_blocks[block] = dead.squeeze(-1).all(1);
    });
    result.backend = backends[0];
    at::Tensor dead_rows;  // [B, Lq] bool: query masked in every head (undefined: none)
    for (int64_t block = 0; block < blocks; ++block) {
      if (!dead_blocks[block].defined()) continue;
      if (!dead_rows.defined())
        dead_rows = at::zeros({b, lq}, at::TensorOptions().dtype(at::kBool));
      dead_rows.narrow(1, block * rows, dead_blocks[block].size(1)).copy_(dead_blocks[block]);
    }
    if (!dst.defined()) result.merged = merged;
    if (dead_rows.defined()) {
      // A query masked in every head gets a zero output row (not the output bias).
      const at::Tensor wire_rows = batch_first ? dead_rows : dead_rows.t();
      result.dead = wire_rows.reshape({b * lq, 1});
    }
    return result;
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
      GemmInto(dst, a.merged, proj_out_, parallel);
    } else {
      at::Tensor projected = at::empty({b * lq, e}, a.merged.options());
      GemmInto(projected, a.merged, proj_out_, parallel);
      dst.copy_(projected);
    }
    if (a.dead.defined()) dst.masked_fill_(a.dead, 0);
  }

  ModelSpec spec_;
  at::Device device_;
  at::ScalarType dtype_;
  // Attention scores' dtype: float32 on the CPU whatever dtype_ (scores, masks and softmax from
  // the products' float32 accumulators); dtype_ on CUDA (its fused kernels take masks in it).
  at::ScalarType score_dtype_;
  // oneDNN's AVX-512 kernels run here: float32 products go to them (onednn::HasAvx512Kernels).
  bool onednn_float32_ = onednn::HasAvx512Kernels();
  double min_piece_flops_;
  // CPU bfloat16 where LibTorch's bfloat16 products accumulate in bfloat16: projection weights are
  // kept in float32 and every matrix product runs in float32, its result rounded to bfloat16.
  bool widen_ = false;
  bool packed_ = false;
  // The input projection ([3E, E], self-attention with kdim = vdim = E; undefined otherwise), q, k
  // and v (its row blocks, or three matrices), and the output projection. Biases undefined without.
  Proj proj_in_, proj_q_, proj_k_, proj_v_, proj_out_;
  at::Tensor bias_k_, bias_v_;  // [E], undefined without add_bias_kv
  // How packed calls attend: kKernel = LibTorch's varlen kernels (CUDA), kEmulate = the same
  // packing by per-sequence attention (tests), kOff = per call.
  enum class Varlen { kOff, kKernel, kEmulate };
  Varlen varlen_;
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
    if (device.is_cuda()) at::globalContext().setAllowTF32CuBLAS(options.allow_tf32);
    c10::InferenceMode guard;
    auto model = std::make_unique<TorchModel>(weights, device, options.compute_dtype,
                                              options.varlen, options.min_piece_flops,
                                              options.force_float32_bfloat16_products);
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
