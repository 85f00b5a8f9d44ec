#pragma once
// Which kernels compute a model on this machine: what the CPU multiplies natively (probed once),
// whether bfloat16 products are widened to float32, which products run on oneDNN, on panel_gemm's
// panels or on the BLAS, how attention over heads computes (fused, small_attention's kernels, the
// own softmax, dense operands), the projections' weights packed accordingly, and the description
// ModelSpec::kernels gives. Decided once per model, at load. One of the engine's LibTorch units.

#include <ATen/ATen.h>

#include <string>

#include "server/core/types.h"
#include "server/engine/head_attention.h"
#include "server/engine/products.h"
#include "server/engine/small_attention.h"
#include "server/weights/model_weights.h"

namespace attnserve {

/// A model's projections: the input projection ([3E, E] when `fused_in`: self-attention with kdim
/// = vdim = E, q, k and v its row blocks; undefined otherwise), q, k and v, and the output
/// projection. Biases undefined without.
struct Projections {
  Proj in, q, k, v, out;
  bool fused_in = false;
};

/// The products' choices for one model (device and compute dtype).
struct KernelChoice {
  /// CPU bfloat16 where the CPU has no bfloat16 products, or where LibTorch's bfloat16 products
  /// accumulate in bfloat16 (or when forced, for tests): projection weights are kept in float32
  /// and every matrix product runs in float32, its result rounded to bfloat16.
  bool widen = false;
  /// oneDNN's AVX-512 kernels run here: float32 products go to them (onednn::HasAvx512Kernels).
  bool onednn_float32 = false;
  /// small_attention's kernels at oneDNN's instruction set, never above this CPU's best: one
  /// ONEDNN_MAX_CPU_ISA caps both, so a CPU runs the engine as one of a lower class would.
  small_attention::Isa kernels = small_attention::Isa::kNone;
  /// Float32 on a CPU whose oneDNN kernels are not AVX-512, under OpenBLAS (measured against it;
  /// MKL's small products were not): the projections on panel_gemm's panels at every height
  /// (AVX2), or elsewhere up to Products::kSmallPackedRows rows on oneDNN's packed weights and the
  /// BLAS for the rest; the projections' weights are packed (a second copy of them). Attention's
  /// products go to oneDNN.
  bool small_packed = false;
  /// A grouped layer's decoding steps attend on small_attention's kernels (ChooseAttention).
  bool small_products = false;
};

/// The products' kernels of a model computing in `dtype` on `device`; `force_widen`: widen CPU
/// bfloat16 whatever the CPU (tests).
KernelChoice ChooseKernels(at::Device device, at::ScalarType dtype, bool force_widen);

/// How the model's attention over heads computes, into `heads` (its shape, scale and window set):
/// its device, scores' dtype and widening, LibTorch's fused kernel, oneDNN's float32 products,
/// small_attention's kernels for a grouped layer's decoding steps (also into
/// `choice->small_products`), the own softmax, dense operands.
void ChooseAttention(const ModelSpec& spec, at::Device device, at::ScalarType dtype,
                     at::ScalarType score_dtype, KernelChoice* choice, HeadAttentionOptions* heads);

/// The projections' weights packed once (onednn.h, panel_gemm.h) as `choice` says, into `proj`
/// (its tensors set): bfloat16 on every CPU that multiplies it, float32 where oneDNN's AVX-512
/// kernels beat the BLAS, and for small_packed in panel_gemm's panels where the CPU runs them, else
/// in oneDNN's layout for small batches only. A projection packed neither way keeps LibTorch's
/// products.
void PackWeights(const ModelWeights& w, const ModelSpec& spec, at::ScalarType dtype,
                 const KernelChoice& choice, Projections* proj);

/// Which kernels compute the model (ModelSpec::kernels).
std::string DescribeKernels(const KernelChoice& choice, const Projections& proj, bool fused,
                            at::Device device, at::ScalarType dtype);

}  // namespace attnserve
