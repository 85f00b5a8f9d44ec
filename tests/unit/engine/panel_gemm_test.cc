// panel_gemm's panels on their own (server/engine/panel_gemm.h) and through Products: x · Wᵀ + b
// for 1 to 513 rows, output widths that are and are not multiples of the panel's 16 columns, with
// and without a bias, strided rows, against float64 with fresh random inputs of fixed seeds
// (tolerance 1e-5 of the result's scale); any range of whole panels bit for bit the whole
// product's, and a row's outputs the same whatever rows share its call (what lets a session's
// step give the same answer alone and in a batch).
#include "server/engine/panel_gemm.h"

#include <gtest/gtest.h>

#include "server/engine/parallel.h"
#include "server/engine/products.h"
#include "tests/lib/torch_check.h"

namespace attnserve {
namespace {

using testing::RelativeError;
const auto Random = testing::RandomTensor;

at::Tensor Reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  at::Tensor want = at::mm(x.to(at::kDouble), w.to(at::kDouble).t());
  return b.defined() ? want + b.to(at::kDouble) : want;
}

TEST(PanelGemmTest, PanelsEqualFloat64ForEveryRowCountWidthAndBias) {
  if (!panel_gemm::Available()) {
    const at::Tensor w = Random({16, 8}, 1);
    EXPECT_EQ(panel_gemm::Panels::Make(w.data_ptr<float>(), nullptr, 16, 8), nullptr);
    GTEST_SKIP() << "no AVX2 and FMA on this CPU: no panels (checked)";
  }
  uint64_t seed = 10;
  for (const int64_t n : {8, 16, 24, 40, 2560}) {
    for (const int64_t k : {1, 7, 64, 517}) {
      for (const bool bias : {true, false}) {
        const at::Tensor w = Random({n, k}, seed++), b = bias ? Random({n}, seed++) : at::Tensor();
        const auto panels = panel_gemm::Panels::Make(w.data_ptr<float>(),
                                                     bias ? b.data_ptr<float>() : nullptr, n, k);
        ASSERT_NE(panels, nullptr);
        EXPECT_EQ(panels->out_features(), n);
        EXPECT_EQ(panels->in_features(), k);
        for (const int64_t m : {1, 2, 5, 6, 7, 13, 64}) {
          // Rows wider than they are read, and outputs past n that must stay untouched.
          const at::Tensor x = Random({m, k + 5}, seed++).narrow(1, 0, k);
          at::Tensor wide = at::full({m, n + 3}, 7.0f);
          panels->Run(x.data_ptr<float>(), m, x.stride(0), wide.data_ptr<float>(), wide.stride(0),
                      0, n);
          EXPECT_LE(RelativeError(wide.narrow(1, 0, n), Reference(x, w, b)), 1e-5)
              << "n " << n << " k " << k << " m " << m << " bias " << bias;
          EXPECT_EQ(wide.narrow(1, n, 3).ne(7.0f).sum().item<int64_t>(), 0) << "n " << n;
        }
      }
    }
  }
}

TEST(PanelGemmTest, PanelRangesAndRowGroupsGiveTheWholeProductBitForBit) {
  if (!panel_gemm::Available()) GTEST_SKIP() << "no AVX2 and FMA on this CPU";
  const int64_t n = 72, k = 300, m = 13;
  const at::Tensor w = Random({n, k}, 20), b = Random({n}, 21), x = Random({m, k}, 22);
  const auto panels = panel_gemm::Panels::Make(w.data_ptr<float>(), b.data_ptr<float>(), n, k);
  at::Tensor whole = at::empty({m, n});
  panels->Run(x.data_ptr<float>(), m, k, whole.data_ptr<float>(), n, 0, n);
  // Column ranges of whole panels, the last ending at n (not a multiple of 16).
  at::Tensor pieces = at::full({m, n}, 7.0f);
  for (const auto [c0, nc] : {std::pair<int64_t, int64_t>{0, 16}, {16, 32}, {48, 16}, {64, 8}})
    panels->Run(x.data_ptr<float>(), m, k, pieces.data_ptr<float>(), n, c0, nc);
  EXPECT_TRUE(at::equal(pieces, whole));
  // Each row alone, and every run of rows: the rows' outputs do not depend on their neighbours.
  for (int64_t i = 0; i < m; ++i) {
    for (const int64_t rows : {int64_t{1}, std::min<int64_t>(7, m - i)}) {
      at::Tensor part = at::empty({rows, n});
      panels->Run(x[i].data_ptr<float>(), rows, k, part.data_ptr<float>(), n, 0, n);
      EXPECT_TRUE(at::equal(part, whole.narrow(0, i, rows))) << "row " << i << " of " << rows;
    }
  }
}

TEST(PanelGemmTest, ProductsCutThePanelsAcrossIdleCoresAsTheSerialProduct) {
  if (!panel_gemm::Available()) GTEST_SKIP() << "no AVX2 and FMA on this CPU";
  const Products products(at::kCPU, at::kFloat, /*min_piece_flops=*/0, /*widen=*/false);
  const HelperPool pool(2);
  const at::Tensor w = Random({200, 96}, 30), b = Random({200}, 31);
  Proj proj{w, b, nullptr,
            panel_gemm::Panels::Make(w.data_ptr<float>(), b.data_ptr<float>(), 200, 96)};
  for (const int64_t rows : {int64_t{1}, Products::kGemvRows, int64_t{32}, Products::kPanelRows,
                             Products::kPanelRows + 1}) {
    const at::Tensor x = Random({rows, 96}, 32 + rows);
    const at::Tensor serial = products.Linear(x, proj, SerialParallel());
    const at::Tensor cut = products.Linear(x, proj, pool);
    EXPECT_LE(RelativeError(cut, Reference(x, w, b)), 1e-5) << rows;
    EXPECT_TRUE(at::equal(cut, serial)) << "rows " << rows;
    // On the panels at every height (past kPanelRows in passes), not the GEMV or the BLAS: the
    // answer is the panels' own in one pass, to the bit.
    at::Tensor own = at::empty({rows, 200});
    proj.panels->Run(x.data_ptr<float>(), rows, 96, own.data_ptr<float>(), 200, 0, 200);
    EXPECT_TRUE(at::equal(cut, own)) << "rows " << rows;
  }
}

}  // namespace
}  // namespace attnserve
