#pragma once
// The engine's matrix products: projections y = x · wᵀ + b on LibTorch, the BLAS or oneDNN's packed
// weights, cut into row blocks for the cores idle at the moment (parallel.h), and one-row products
// as matrix-vector products. Included only by the engine's LibTorch translation units.

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <exception>
#include <memory>
#include <mutex>
#include <utility>

#include "server/engine/onednn.h"
#include "server/engine/panel_gemm.h"
#include "server/engine/parallel.h"

namespace attnserve {

/// One projection: y = x · wᵀ + b. w [out, in] and b [out] (undefined: no bias) as LibTorch
/// tensors; `packed` (CPU): the same weights reordered once into the layout oneDNN's kernels read,
/// which the products use where it runs; `panels` (AVX2 CPUs, float32): the same weights in
/// panel_gemm's panels, which every product of the projection runs on.
struct Proj {
  at::Tensor w, b;
  std::shared_ptr<const onednn::PackedLinear> packed;
  std::shared_ptr<const panel_gemm::Panels> panels;
};

/// How one model's products run: its device, its compute dtype, the least work worth a piece of
/// its own, and whether bfloat16 products are widened to float32 (CPUs whose bfloat16 products add
/// in bfloat16). Thread-safe.
class Products {
 public:
  /// A GEMM piece has at least this many rows (the BLAS kernels' height).
  static constexpr int64_t kMinGemmRows = 16;
  /// Up to this many rows, a product on packed weights is cut across the idle cores by its output
  /// columns, not its rows: each core then reads its part of the weights, which is most of what a
  /// decoding batch's product reads (cut by rows, every core read all of them). A batched step of
  /// 32 sessions of a [2560, 2048] projection (Zen 5, 2 cores): 1.15 ms cut by rows.
  static constexpr int64_t kColumnRows = 64;
  /// Up to this many rows, a float32 product on the CPU runs as one matrix-vector product per row:
  /// an OpenBLAS GEMM call has a fixed cost (it packs the whole weight matrix and computes whole
  /// micro-tiles), which a one-token decoding step would pay per projection: against [3E, E] at
  /// E=512 here a 1-row GEMM took 0.30 ms, 4 rows 0.25, 16 rows 0.46, a GEMV 0.05 ms a row. Not
  /// on packed weights, which read the weights once for all the rows (UseGemv).
  static constexpr int64_t kGemvRows = 4;

  /// Float32 products of up to this many rows run on oneDNN's packed weights where its kernels
  /// are not AVX-512 (AVX2): a decoding batch's height. Measured here (2-core AVX2 EPYC, one
  /// thread; bench/RESULTS.md) against OpenBLAS, which packs the whole weight matrix on every
  /// call: [2560, 2048] at 10 rows 2.3 ms against 4.3, [6144, 2048] 7.8 against 12.0; at 16 rows
  /// 1.04-1.26x, at 24 about even, past 32 the BLAS wins.
  static constexpr int64_t kSmallPackedRows = 16;

  /// Float32 products run on panel_gemm's panels where a projection has them (AVX2 CPUs under
  /// OpenBLAS), at every height: the output columns cut across the idle cores, the rows in passes
  /// of up to this many (each pass reads the weights once; its rows stay in the caches across the
  /// panels). Measured here (2-core AVX2 EPYC, Zen 3; bench/RESULTS.md) against the BLAS and
  /// oneDNN's packed weights, both cores: [2560, 2048] at 8 rows 1.0 ms against 1.9-2.9, 32 rows
  /// 1.6-2.2 against 2.7-4.2; [2048, 2048] at 512 rows 24 ms against 31; [1536, 512] at 256 rows
  /// 2.1 ms against 3.2 (~190 GFLOP/s, 95% of the FMA peak, against 127).
  static constexpr int64_t kPanelRows = 512;

  /// `packed_max_rows`: the most rows a product runs on packed weights (0: any; a projection
  /// without packed weights never does).
  Products(at::Device device, at::ScalarType dtype, double min_piece_flops, bool widen,
           int64_t packed_max_rows = 0)
      : device_(device),
        dtype_(dtype),
        min_piece_flops_(min_piece_flops),
        widen_(widen),
        packed_max_rows_(packed_max_rows) {}

  /// Threads the work may be cut for: the idle cores on the CPU; one on a GPU (its kernels are
  /// parallel already, and one stream per worker keeps their order).
  int64_t Width(const Parallel& parallel) const { return device_.is_cpu() ? parallel.Width() : 1; }
  /// How many pieces of at least `min_rows` rows to cut `rows` rows into, each worth
  /// `flops_per_row`, each piece at least min_piece_flops of work.
  int64_t Blocks(const Parallel& parallel, int64_t rows, double flops_per_row,
                 int64_t min_rows) const;
  /// [start, size) of block i when `total` rows are cut into `blocks` nearly equal blocks.
  static std::pair<int64_t, int64_t> Block(int64_t total, int64_t blocks, int64_t i);

  /// Runs fn(i) for i in [0, n) on `parallel`'s threads, each piece under its own inference mode
  /// (it is thread-local); the first exception a piece throws comes back here once all have run.
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

  /// x [rows, in] · projᵀ (+ b) into y [rows, out], the rows cut into blocks, one GEMM each, when
  /// cores are idle: every output row is computed as the single GEMM would. Too few rows for two
  /// blocks (a decoding batch) on packed weights: the output columns cut instead, each core reading
  /// its columns' weights alone, every output bit for bit the whole product's.
  void GemmInto(const at::Tensor& y, const at::Tensor& x, const Proj& proj,
                const Parallel& parallel) const;
  /// nn.functional.linear(x, w, b), split as GemmInto.
  at::Tensor Linear(const at::Tensor& x, const Proj& proj, const Parallel& parallel) const;
  /// a · b (batched as at::matmul), in float32 and rounded back when bfloat16 products are widened.
  at::Tensor Matmul(const at::Tensor& a, const at::Tensor& b) const;

 private:
  // Whether proj's packed weights take x's rows: it has them, the rows are within the limit, in
  // the packed type, with unit column stride.
  bool PackedTakes(const at::Tensor& x, const Proj& proj) const;
  // Whether x's rows times proj run as one GEMV a row: float32 on the CPU, up to kGemvRows rows,
  // unless proj's packed weights take them.
  bool UseGemv(const at::Tensor& x, const Proj& proj) const;
  // y = x · wt (+ b) row by row as matrix-vector products (for UseGemv).
  static void GemvInto(const at::Tensor& y, const at::Tensor& x, const at::Tensor& wt,
                       const at::Tensor& b);
  // The product on the packed weights when oneDNN runs it: x [rows, in] and y [rows, out] with
  // unit column strides, x in the packed type, y in it or float32.
  bool RunPacked(const Proj& proj, const at::Tensor& x, const at::Tensor& y) const;
  // Whether proj's packed weights take x's rows and write y's (unit column stride, in the packed
  // type or float32), and in which type y is written.
  bool PackedWrites(const Proj& proj, const at::Tensor& x, const at::Tensor& y,
                    onednn::Type* y_type) const;
  // x · projᵀ (+ b) into y with the output columns cut into blocks for `parallel`'s idle threads,
  // on proj's packed weights (each piece reads its columns' weights alone; every output as the
  // whole product computes it). False when that does not run here (nothing or only part written).
  bool ColumnsInto(const at::Tensor& y, const at::Tensor& x, const Proj& proj,
                   const Parallel& parallel) const;
  // How many pieces to cut a product of `multiply_adds` into by its `column_blocks` blocks of
  // output columns: one a thread idle now, each at least min_piece_flops_ (at least one piece).
  int64_t ColumnPieces(const Parallel& parallel, int64_t column_blocks,
                       int64_t multiply_adds) const;
  // x · projᵀ + b into y on proj's panels, the panels cut across `parallel`'s idle threads, the
  // rows kPanelRows at a time: float32 x and y with unit column strides. False (nothing written)
  // otherwise.
  bool PanelsInto(const at::Tensor& y, const at::Tensor& x, const Proj& proj,
                  const Parallel& parallel) const;

  at::Device device_;
  at::ScalarType dtype_;
  double min_piece_flops_;
  bool widen_;
  int64_t packed_max_rows_;
};

}  // namespace attnserve
