#pragma once
// The one place that knows which LibTorch version attnserve is built against. Included only by the
// engine's LibTorch translation units.

#include <ATen/ATen.h>
#include <torch/version.h>

#include <optional>
#include <string>

namespace attnserve::compat {

/// Whether a LibTorch error is a device running out of memory (the caller refuses the batch with
/// RESOURCE_EXHAUSTED rather than treating it as a kernel's refusal).
inline bool IsOutOfMemory(const c10::Error& e) {
  return std::string(e.what_without_backtrace()).find("out of memory") != std::string::npos;
}

#if TORCH_VERSION_MAJOR >= 2
/// LibTorch 2.x: at::scaled_dot_product_attention picks a fused kernel (flash, memory-efficient,
/// cuDNN on CUDA; a fused flash-style kernel on CPU) and falls back to math by itself.
inline constexpr bool kHasFusedSdpa = true;
inline at::Tensor FusedSdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& additive_mask, bool is_causal) {
  c10::optional<at::Tensor> mask;
  if (additive_mask.defined()) mask = additive_mask;
  return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, is_causal);
}
/// Keeps FusedSdpa off cuDNN's attention: it compiles a kernel at run time for each new shape
/// (bench/RESULTS.md, H200 with LibTorch 2.11: every worker inside cuDNN's runtime compiler and 7
/// requests a second for 64 callers of lengths 64-2048, against hundreds with the shapes fixed),
/// where flash and memory-efficient attention are compiled ahead of time for every length.
inline void AvoidRuntimeCompiledAttention() {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3
  at::globalContext().setSDPUseCuDNN(false);
#endif
}
/// Which kernel FusedSdpa will run for these inputs (for metrics).
inline const char* FusedSdpaBackend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& additive_mask, bool is_causal) {
  c10::optional<at::Tensor> mask;
  if (additive_mask.defined()) mask = additive_mask;
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
  const int64_t choice = at::_fused_sdp_choice(q, k, v, mask, 0.0, is_causal, c10::nullopt, false);
#elif TORCH_VERSION_MINOR >= 1
  const int64_t choice = at::_fused_sdp_choice(q, k, v, mask, 0.0, is_causal, c10::nullopt);
#else
  const int64_t choice = at::_fused_sdp_choice(q, k, v, mask, 0.0, is_causal);
#endif
  switch (choice) {  // sdp::SDPBackend
    case 0:
      return "math";
    case 1:
      return "flash";
    case 2:
      return "efficient";
    case 3:
      return "cudnn";
    default:
      return "other";
  }
}
#endif

/// One varlen attention launch's result: the output rows and the kernel that produced them.
struct VarlenOutput {
  at::Tensor out;                 // [total_q, H, D]
  const char* backend = nullptr;  // "flash_varlen" or "efficient_varlen"
};

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
/// LibTorch >= 2.11 (the signatures below were checked against 2.11's headers; earlier 2.x builds
/// attend per request): ragged sequences packed along rows, no padding. q [total_q, H, D], k and v
/// [total_k, H, D], each with a contiguous last dimension; cu_q, cu_k int32 [n + 1] row offsets on
/// the GPU; `causal`: query i of a sequence sees its keys 0..i (top-left, as
/// nn.MultiheadAttention's is_causal), `square`: every sequence has as many keys as queries. Flash
/// attention's varlen kernel where it applies (float16/bfloat16, head_dim a multiple of 8 and <=
/// 256, an sm80+ GPU, and for causal only square sequences: its causal mask is aligned
/// bottom-right); otherwise the memory-efficient kernel's varlen form (any float dtype; custom mask
/// type 1 = causal from the top left). CUDA only. Throws c10::Error where neither kernel takes the
/// inputs.
inline constexpr bool kHasVarlen = true;
inline VarlenOutput VarlenAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q,
                                    int64_t max_k, bool causal, bool square, double scale) {
  const int64_t d = q.size(-1);
  const bool half = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  if (half && d % 8 == 0 && d <= 256 && (!causal || square)) {
    try {
      auto r = at::_flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, /*dropout_p=*/0.0,
                                            causal, /*return_debug_mask=*/false, scale);
      return {std::get<0>(r), "flash_varlen"};
    } catch (const c10::Error& e) {
      // E.g. a GPU older than sm80; an out-of-memory is the caller's to handle.
      if (IsOutOfMemory(e)) throw;
    }
  }
  auto r = at::_efficient_attention_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                            /*bias=*/c10::nullopt, cu_q, cu_k, max_q, max_k,
                                            /*dropout_p=*/0.0, /*custom_mask_type=*/causal ? 1 : 0,
                                            /*compute_log_sumexp=*/false, scale);
  return {std::get<0>(r).squeeze(0), "efficient_varlen"};
}
/// Steps of many kept sessions in one launch (the same LibTorch versions): q [n, H, D] their new
/// tokens' queries, sequence after sequence (cu_q int32 [S + 1]); k and v [rows, KVH, D] a
/// KvPool chunk's rows, sequence s's keys `used[s]` rows from row `start[s]` (int32, [S + 1] and
/// [S] on the GPU; start's last entry is not read). Causal from the bottom right (a step's tokens
/// are its keys' last), a sliding window of `window` keys (0: none). Flash attention's varlen
/// kernel reads grouped key/value heads in place (float16/bfloat16, head_dim a multiple of 8 and
/// <= 256, sm80+); otherwise the memory-efficient kernel for ungrouped heads without a window.
/// Throws c10::Error where neither takes the inputs.
inline VarlenOutput KeptVarlenAttention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& cu_q,
                                        const at::Tensor& start, const at::Tensor& used,
                                        int64_t max_q, int64_t max_k, double scale,
                                        int64_t window) {
  const int64_t d = q.size(-1);
  const bool half = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  if (half && d % 8 == 0 && d <= 256) {
    try {
      std::optional<int64_t> left, right;
      if (window > 0) left = window - 1, right = 0;
      auto r = at::_flash_attention_forward(q, k, v, cu_q, start, max_q, max_k, /*dropout_p=*/0.0,
                                            /*is_causal=*/true, /*return_debug_mask=*/false, scale,
                                            left, right, used);
      return {std::get<0>(r), "flash_kept"};
    } catch (const c10::Error& e) {
      if (IsOutOfMemory(e)) throw;
    }
  }
  TORCH_CHECK(q.size(1) == k.size(1) && window == 0,
              "kept varlen attention: grouped heads or a window need flash attention");
  auto r = at::_efficient_attention_forward(
      q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), /*bias=*/c10::nullopt, cu_q, start, max_q,
      max_k, /*dropout_p=*/0.0, /*custom_mask_type=*/2 /* causal from the bottom right */,
      /*compute_log_sumexp=*/false, scale, used);
  return {std::get<0>(r).squeeze(0), "efficient_kept"};
}
#else
inline constexpr bool kHasVarlen = false;
inline VarlenOutput KeptVarlenAttention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        int64_t, int64_t, double, int64_t) {
  TORCH_CHECK(false, "kept varlen attention needs LibTorch >= 2.11");
}
inline VarlenOutput VarlenAttention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool,
                                    bool, double) {
  TORCH_CHECK(false, "varlen attention needs LibTorch >= 2.11");
}
#endif

#if TORCH_VERSION_MAJOR < 2
/// LibTorch 1.13 has no public fused attention: its at::_scaled_dot_product_attention runs the same
/// math composite on CPU, so the engine's explicit math path is used instead.
inline constexpr bool kHasFusedSdpa = false;
inline at::Tensor FusedSdpa(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, bool) {
  TORCH_CHECK(false, "fused scaled_dot_product_attention needs LibTorch >= 2.0");
}
inline const char* FusedSdpaBackend(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, bool) {
  return "math";
}
#endif

}  // namespace attnserve::compat
