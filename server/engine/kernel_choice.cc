#include "server/engine/kernel_choice.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <optional>

#include "server/engine/blas.h"
#include "server/engine/onednn.h"
#include "server/engine/panel_gemm.h"
#include "server/engine/torch_compat.h"

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

}  // namespace

KernelChoice ChooseKernels(at::Device device, at::ScalarType dtype, bool force_widen) {
  KernelChoice k;
  k.widen = dtype == at::kBFloat16 && device.is_cpu() &&
            (force_widen || !CpuHasBfloat16Products() || !CpuBfloat16ProductsAccumulateInFloat32());
  k.onednn_float32 = onednn::HasAvx512Kernels();
  k.kernels =
      std::min(small_attention::Best(), onednn::HasAvx512Kernels() ? small_attention::Isa::kAvx512
                                                                   : small_attention::Isa::kAvx2);
  k.small_packed =
      device.is_cpu() && dtype == at::kFloat && !k.onednn_float32 && ConfigureBlas().openblas;
  return k;
}

void ChooseAttention(const ModelSpec& spec, at::Device device, at::ScalarType dtype,
                     at::ScalarType score_dtype, KernelChoice* choice,
                     HeadAttentionOptions* heads) {
  heads->device = device;
  heads->score_dtype = score_dtype;
  heads->widen = choice->widen;
  // LibTorch's fused kernel (2.x). Not for CPU bfloat16: the oneDNN math path (float32 scores)
  // was faster than 2.11's CPU flash kernel at every shape measured (in-process W1 302k against
  // 264k tokens/s, W2 347k against 206k, a lone [1, 1024, 512] request 8.4 against 16.9 ms;
  // bench/RESULTS.md), and as accurate.
  // Grouped heads too, a group's query rows as one head's (HeadAttention::RunBlock): on the
  // math path an H200 stepped a grouped layer 0.90x as fast as an ungrouped one (RESULTS.md).
  heads->fused =
      compat::kHasFusedSdpa && !(device.is_cpu() && dtype == at::kBFloat16) && heads->scale == 0;
  // float32 attention products through oneDNN on every CPU it has kernels for: LibTorch's float32
  // bmm calls the BLAS, at half oneDNN's speed on the AVX-512 EPYC measured, and slower on the
  // AVX2 EPYC too (1.1-1.3x on prefill shapes; a one-token step over 1,100 keys in 32 heads 1.9
  // ms against 0.6).
  heads->onednn_float32 = choice->onednn_float32 || choice->small_packed;
  // A grouped layer's decoding step (a group's G query heads as the rows of one key/value head)
  // through small_attention's kernels, which read each kept key and value once from its row:
  // [4, 8, 64] over 1,121 cold keys, scores 0.14 ms and values 0.15 against oneDNN's 0.24 and
  // 0.19 on the AVX2 EPYC; [4, 8, 64] over 1,100 cold keys on the AVX-512 EPYC (Zen 5), scores
  // 0.024 ms and values 0.037 (the AVX-512 kernels) against oneDNN's AVX-512 0.077-0.092 and
  // 0.060-0.066 (the grouped layer's decoding steps +10%). Grouped models only: a plain model's
  // attention stays bit for bit what it was (its short prefills, the kernels' other shapes,
  // measured even). Not where the fused kernel runs (LibTorch 2.x: unchanged, not measured
  // against them), and in float32 only (widened bfloat16 too).
  choice->small_products = device.is_cpu() && !heads->fused && spec.kv_heads() < spec.num_heads &&
                           (dtype == at::kFloat || choice->widen) &&
                           choice->kernels != small_attention::Isa::kNone;
  heads->small_products = choice->small_products;
  const bool cpu_bfloat16 = device.is_cpu() && dtype == at::kBFloat16 && !choice->widen;
  // The softmax on the engine's own kernel (AVX-512, or AVX2's eight lanes) for a grouped
  // layer's float32 decoding steps (small products) and CPU bfloat16 (its float32 scores,
  // bfloat16 probabilities): W2 bfloat16 on the AMX Xeon's engine bench 13.9 -> 10.8 ms a batch.
  // Plain float32 models keep LibTorch's softmax (their answers bit for bit what they were).
  heads->own_softmax = choice->small_products || cpu_bfloat16;
  // CPU bfloat16 attention on dense copies of its operands where oneDNN's kernels take no other
  // (AMX; onednn::WantsDenseOperands).
  heads->dense_products = cpu_bfloat16 && onednn::WantsDenseOperands();
  heads->kernels = choice->kernels;
}

void PackWeights(const ModelWeights& w, const ModelSpec& spec, at::ScalarType dtype,
                 const KernelChoice& choice, Projections* proj) {
  const bool all =
      (dtype == at::kBFloat16 && !choice.widen) || (dtype == at::kFloat && choice.onednn_float32);
  if (!all && !choice.small_packed) return;
  const onednn::Type type =
      dtype == at::kBFloat16 ? onednn::Type::kBFloat16 : onednn::Type::kFloat32;
  const bool panels = !all && panel_gemm::Available();
  const auto pack = [type, panels](Proj* p, const HostTensor& weight,
                                   const std::optional<HostTensor>& bias, int64_t bias_offset) {
    const float* b = bias ? bias->values.data() + bias_offset : nullptr;
    if (panels) {
      p->panels =
          panel_gemm::Panels::Make(weight.values.data(), b, weight.shape[0], weight.shape[1]);
    } else {
      p->packed = onednn::PackedLinear::Make(weight.values.data(), b, weight.shape[0],
                                             weight.shape[1], type);
    }
  };
  const int64_t e = spec.embed_dim, wq = spec.q_width(), wkv = spec.kv_width();
  if (all || !proj->fused_in) {
    pack(&proj->q, w.q_proj, w.in_proj_bias, 0);
    pack(&proj->k, w.k_proj, w.in_proj_bias, wq);
    pack(&proj->v, w.v_proj, w.in_proj_bias, wq + wkv);
  }
  pack(&proj->out, w.out_proj, w.out_proj_bias, 0);
  if (proj->fused_in) {
    HostTensor in;
    in.shape = {wq + 2 * wkv, e};
    for (const HostTensor* part : {&w.q_proj, &w.k_proj, &w.v_proj})
      in.values.insert(in.values.end(), part->values.begin(), part->values.end());
    pack(&proj->in, in, w.in_proj_bias, 0);
  }
}

std::string DescribeKernels(const KernelChoice& choice, const Projections& proj, bool fused,
                            at::Device device, at::ScalarType dtype) {
  if (device.is_cuda()) return "LibTorch CUDA";
  std::string s;
  if (proj.out.panels) {
    s = "float32 projections on AVX2 kernels over weights in panels of " +
        std::to_string(panel_gemm::Panels::kColumns) + " columns, LibTorch's other products";
  } else if (proj.out.packed && choice.small_packed) {
    s = "LibTorch float32 products (BLAS); up to " + std::to_string(Products::kSmallPackedRows) +
        " rows oneDNN float32 on packed weights (" + proj.out.packed->Layout() + ")";
  } else if (proj.out.packed) {
    s = std::string("oneDNN ") + (dtype == at::kBFloat16 ? "bfloat16" : "float32") +
        " on packed weights (" + proj.out.packed->Layout() + ")";
  } else if (choice.widen) {
    s = "float32 products rounded to bfloat16 (no bfloat16 products here)";
  } else {
    s = std::string("LibTorch ") + c10::toString(dtype) + " products (BLAS)";
  }
  s += fused ? ", fused attention" : ", attention";
  if (dtype != at::kFloat) s += " with float32 scores";
  if (choice.small_products) {
    s += choice.kernels == small_attention::Isa::kAvx512
             ? " (grouped decoding steps on AVX2 and AVX-512 kernels)"
             : " (grouped decoding steps on AVX2 kernels)";
  }
  return s;
}

}  // namespace attnserve
