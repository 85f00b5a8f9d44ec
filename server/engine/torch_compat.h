#pragma once
// The one place that knows which LibTorch version attnserve is built against. Included only by the
// engine's LibTorch translation units.

#include <ATen/ATen.h>
#include <torch/version.h>

namespace attnserve::compat {

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
    case 0: return "math";
    case 1: return "flash";
    case 2: return "efficient";
    case 3: return "cudnn";
    default: return "other";
  }
}
#else
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
