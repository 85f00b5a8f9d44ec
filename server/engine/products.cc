#include "server/engine/products.h"

#include <algorithm>
#include <atomic>
#include <cmath>

namespace attnserve {

int64_t Products::Blocks(const Parallel& parallel, int64_t rows, double flops_per_row,
                         int64_t min_rows) const {
  const int64_t width = Width(parallel);
  if (width <= 1) return 1;
  const auto by_flops =
      static_cast<int64_t>(std::ceil(min_piece_flops_ / std::max(flops_per_row, 1.0)));
  return std::max<int64_t>(1, std::min(width, rows / std::max(min_rows, by_flops)));
}

std::pair<int64_t, int64_t> Products::Block(int64_t total, int64_t blocks, int64_t i) {
  const int64_t base = total / blocks, extra = total % blocks;
  return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

bool Products::PackedTakes(const at::Tensor& x, const Proj& proj) const {
  return proj.packed && (packed_max_rows_ == 0 || x.size(0) <= packed_max_rows_) &&
         x.scalar_type() == dtype_ && x.stride(1) == 1;
}

bool Products::UseGemv(const at::Tensor& x, const Proj& proj) const {
  // Packed weights, read once for every row, take a few rows too (products_test.cc's figures):
  // any number where they are not limited (AVX-512), from 2 rows under a limit (AVX2).
  const bool packed = PackedTakes(x, proj) && (packed_max_rows_ == 0 || x.size(0) > 1);
  return device_.is_cpu() && x.size(0) <= kGemvRows && x.scalar_type() == at::kFloat &&
         proj.w.scalar_type() == at::kFloat && !packed;
}

void Products::GemvInto(const at::Tensor& y, const at::Tensor& x, const at::Tensor& wt,
                        const at::Tensor& b) {
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

void Products::GemmInto(const at::Tensor& y, const at::Tensor& x, const Proj& proj,
                        const Parallel& parallel) const {
  if (PanelsInto(y, x, proj, parallel)) return;
  const at::Tensor wt = proj.w.t();
  const at::Tensor& b = proj.b;
  if (UseGemv(x, proj) && y.scalar_type() == at::kFloat) {
    GemvInto(y, x, wt, b);
    return;
  }
  const int64_t blocks = Blocks(parallel, x.size(0), 2.0 * wt.size(0) * wt.size(1), kMinGemmRows);
  // Too few rows to cut, or few enough that the weights are most of what the product reads, with
  // cores idle: the output columns cut instead, so that each core reads its part of the weights (a
  // decoding batch's product reads little else).
  if ((blocks == 1 || x.size(0) <= kColumnRows) && ColumnsInto(y, x, proj, parallel)) return;
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

bool Products::PackedWrites(const Proj& proj, const at::Tensor& x, const at::Tensor& y,
                            onednn::Type* y_type) const {
  if (!PackedTakes(x, proj) || y.stride(1) != 1 ||
      (y.scalar_type() != at::kBFloat16 && y.scalar_type() != at::kFloat))
    return false;
  *y_type = y.scalar_type() == at::kFloat ? onednn::Type::kFloat32 : onednn::Type::kBFloat16;
  return true;
}

int64_t Products::ColumnPieces(const Parallel& parallel, int64_t column_blocks,
                               int64_t multiply_adds) const {
  const double flops = 2.0 * static_cast<double>(multiply_adds);
  return std::max<int64_t>(
      1, std::min({Width(parallel), column_blocks,
                   static_cast<int64_t>(flops / std::max(min_piece_flops_, 1.0))}));
}

bool Products::ColumnsInto(const at::Tensor& y, const at::Tensor& x, const Proj& proj,
                           const Parallel& parallel) const {
  const int64_t width = Width(parallel);
  onednn::Type y_type;
  if (width <= 1 || !PackedWrites(proj, x, y, &y_type)) return false;
  const onednn::PackedLinear& w = *proj.packed;
  const int64_t n = w.out_features(), block = w.ColumnBlock();
  const int64_t pieces = ColumnPieces(parallel, n / block, x.size(0) * n * w.in_features());
  if (pieces <= 1) return false;
  std::atomic<bool> refused{false};
  Pieces(parallel, pieces, [&](int64_t i) {
    const auto [b0, blocks] = Block(n / block, pieces, i);
    const int64_t n0 = b0 * block, nn = i == pieces - 1 ? n - n0 : blocks * block;
    if (!w.RunColumns(x.data_ptr(), x.size(0), x.stride(0), y.data_ptr(), y_type, y.stride(0), n0,
                      nn))
      refused = true;
  });
  return !refused;  // (Refused: the caller computes every column again its own way.)
}

bool Products::PanelsInto(const at::Tensor& y, const at::Tensor& x, const Proj& proj,
                          const Parallel& parallel) const {
  if (!proj.panels || x.size(0) == 0 || x.scalar_type() != at::kFloat ||
      y.scalar_type() != at::kFloat || x.stride(1) != 1 || y.stride(1) != 1)
    return false;
  const panel_gemm::Panels& w = *proj.panels;
  constexpr int64_t kColumns = panel_gemm::Panels::kColumns;
  const int64_t n = w.out_features(), count = (n + kColumns - 1) / kColumns;
  for (int64_t r0 = 0; r0 < x.size(0); r0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, x.size(0) - r0);
    const int64_t pieces = ColumnPieces(parallel, count, rows * n * w.in_features());
    const float* xp = x.data_ptr<float>() + r0 * x.stride(0);
    float* yp = y.data_ptr<float>() + r0 * y.stride(0);
    Pieces(parallel, pieces, [&](int64_t i) {
      const auto [p0, panels] = Block(count, pieces, i);
      const int64_t c0 = p0 * kColumns;
      w.Run(xp, rows, x.stride(0), yp, y.stride(0), c0, std::min(n, (p0 + panels) * kColumns) - c0);
    });
  }
  return true;
}

bool Products::RunPacked(const Proj& proj, const at::Tensor& x, const at::Tensor& y) const {
  onednn::Type y_type;
  return PackedWrites(proj, x, y, &y_type) &&
         proj.packed->Run(x.data_ptr(), x.size(0), x.stride(0), y.data_ptr(), y_type, y.stride(0));
}

at::Tensor Products::Linear(const at::Tensor& x, const Proj& proj, const Parallel& parallel) const {
  const at::Tensor& w = proj.w;
  const at::Tensor& b = proj.b;
  if (proj.panels) {  // Every height (GemmInto takes another way for rows they refuse).
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    GemmInto(y, x, proj, parallel);
    return y;
  }
  if (UseGemv(x, proj)) {
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

at::Tensor Products::Matmul(const at::Tensor& a, const at::Tensor& b) const {
  if (!widen_) return at::matmul(a, b);
  return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
}

}  // namespace attnserve
