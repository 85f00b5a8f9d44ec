#pragma once
// Float32 projections on AVX2 CPUs: y = x · Wᵀ + b with W reordered once into panels of 16 output
// columns (each panel's rows of k, column-major within: what one step of the kernel reads). The
// BLAS (OpenBLAS, which packs the whole weight matrix on every call) and oneDNN's AVX2 kernels ran
// a decoding batch's products at a third to a half of the cores' float32 peak, and taller ones at
// ~65-85% (bench/RESULTS.md, issue 65's AVX2 class); here six rows at a time take twelve
// accumulators, each panel's vectors loaded once for them: ~95% at 16 rows and more. Detected at
// run time (AVX2 and FMA); no LibTorch here: plain pointers and strides in elements.

#include <cstdint>
#include <memory>
#include <vector>

namespace attnserve::panel_gemm {

/// Whether this CPU runs the kernel (AVX2 and FMA).
bool Available();

/// W [n, k] (row-major) and its bias [n] (or none) in panels of kColumns output columns, the last
/// one padded with zeros. Immutable once made: one copy serves every thread at once.
class Panels {
 public:
  static constexpr int64_t kColumns = 16;

  /// Null where the CPU lacks the kernel, or for an empty shape.
  static std::unique_ptr<Panels> Make(const float* w, const float* bias, int64_t n, int64_t k);

  /// y[i][c] = b[c] + Σ_j x[i][j] · W[c][j] for i < m and output columns c in [c0, c0 + nc); x rows
  /// at stride ldx, y rows at stride ldy (y points at column 0). c0 a multiple of kColumns, c0 + nc
  /// one too or n. Each output is summed in one order (the bias, then j ascending), whatever the
  /// rows beside it or the columns asked: the columns written are the whole product's, bit for bit.
  void Run(const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy, int64_t c0,
           int64_t nc) const;

  int64_t out_features() const { return n_; }
  int64_t in_features() const { return k_; }

 private:
  Panels(int64_t n, int64_t k) : n_(n), k_(k) {}
  int64_t n_, k_;
  std::vector<float> panels_;  // Panel p: k rows of kColumns floats (W[p·16 + c][j] at [j][c]).
  std::vector<float> bias_;    // Padded to whole panels (zeros: no bias).
};

}  // namespace attnserve::panel_gemm
