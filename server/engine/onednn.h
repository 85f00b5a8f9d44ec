// Matrix products straight through oneDNN, the library LibTorch's own CPU products call (Debian's
// libdnnl, the one LibTorch 1.13 links): where LibTorch's ops cannot say what the engine needs.
//   * bfloat16 operands with a float32 result (attention scores kept in float32 from the
//     products' float32 accumulators: LibTorch 1.13 rounds a bfloat16 product's result to
//     bfloat16);
//   * weights reordered once, at model load, into the blocked layout the matrix-unit kernels read
//     (LibTorch hands oneDNN the plain layout and the AMX kernels pack it again on every call).
// Primitives are made once per shape and kept (a bounded cache); each thread executes on its own
// stream with its own scratchpad, so one primitive serves every compute thread at once. No LibTorch
// here: plain pointers, dims and strides.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace attnserve::onednn {

enum class Type { kFloat32, kBFloat16 };

/// A strided view of a (batched) matrix: dims and strides in elements, outermost first.
struct View {
  void* data = nullptr;
  Type type = Type::kFloat32;
  std::vector<int64_t> dims, strides;
};

/// The CPU's class for bfloat16 products, as oneDNN dispatches them: "AMX" (amx_bf16 tiles),
/// "AVX512-BF16" (vdpbf16ps), "AVX-512 without BF16", or "AVX2 only" (no bfloat16 instructions).
std::string CpuClass();
/// Whether oneDNN multiplies bfloat16 natively here (AVX512-BF16 or AMX kernels).
bool HasBfloat16Kernels();
/// Whether oneDNN's kernels here are its AVX-512 ones (brgemm): float32 products on packed weights
/// then beat the BLAS (bench/RESULTS.md); on AVX2-only CPUs only small batches' float32
/// projections (Products::kSmallPackedRows) and attention's products do.
bool HasAvx512Kernels();
/// Whether bfloat16 products here want dense operands (every dim's stride the product of the
/// inner dims'): oneDNN 2.6's AMX kernels take no other, and strided ones (the heads of projected
/// rows, kept rows short of their capacity) go to gemm:jit, which with a scale runs ~10x slower
/// on AMX ([8, 256, 64] x [8, 64, 381] scaled: 4.5 ms on one core, dense 0.36 ms). Its AVX512-BF16
/// kernels take strided operands at about the speed of dense ones.
bool WantsDenseOperands();
/// oneDNN's version and the ISA its kernels use here, e.g. "oneDNN 2.6.3, avx512_core_bf16".
std::string Describe();

/// dst = alpha · a · b over the batch dims (a [..., M, K], b [..., K, N], dst [..., M, N]; a batch
/// dim of 1 broadcasts). Types: a and b alike; dst float32 or their type. Returns false (and does
/// nothing) when oneDNN has no kernel for these operands other than its reference one; the caller
/// then multiplies another way.
bool Matmul(const View& a, const View& b, const View& dst, float alpha);

/// y [M, N] = x [M, K] · Wᵀ + bias, with W [N, K] reordered once into the layout oneDNN's kernels
/// for this CPU want. Thread-safe; the products of every M share the one packed copy.
class PackedLinear {
 public:
  /// w: [n, k] row-major, bias: [n] or null, both float32 values; type: the compute type (weights
  /// and x). Returns null when oneDNN packs no kernel for this type here.
  static std::unique_ptr<PackedLinear> Make(const float* w, const float* bias, int64_t n, int64_t k,
                                            Type type);
  ~PackedLinear();
  /// x: [m, k] with row stride ldx, type as made; y: [m, n] with row stride ldy, in that type or
  /// float32. Returns false when no kernel took these operands (nothing written).
  bool Run(const void* x, int64_t m, int64_t ldx, void* y, Type y_type, int64_t ldy) const;
  /// The same for output columns [n0, n0 + nn) only (y points at column 0): n0 and nn multiples
  /// of ColumnBlock() (nn may end at n). False (nothing written) when they are not, when no
  /// kernel took them, or when oneDNN's kernel for them is not the whole product's (Kernel): the
  /// columns written are the whole product's, bit for bit.
  bool RunColumns(const void* x, int64_t m, int64_t ldx, void* y, Type y_type, int64_t ldy,
                  int64_t n0, int64_t nn) const;
  /// oneDNN's kernel for those operands, as its verbose lines name it (e.g.
  /// "brg:avx512_core_amx_bf16"); empty when none but its reference one takes them.
  std::string Kernel(int64_t m, int64_t ldx, Type y_type, int64_t n0, int64_t nn) const;
  /// The packed layout's block of output columns (64 for "BA16a64b"; n where the layout cannot
  /// be cut by columns: not blocked, or its column blocks not outermost, e.g. "ab" on AVX2).
  int64_t ColumnBlock() const;
  int64_t out_features() const;
  int64_t in_features() const;
  /// The packed layout, as oneDNN's verbose lines print it (e.g. "BA16a64b2a").
  std::string Layout() const;

 private:
  struct Impl;
  explicit PackedLinear(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve::onednn
