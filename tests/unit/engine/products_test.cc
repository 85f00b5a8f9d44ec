// The engine's products on their own (server/engine/products.h): projections cut into row blocks
// across helper threads, one-row matrix-vector products, widened bfloat16, against a float64
// reference with fresh random inputs of fixed seeds. Tolerances: float32 1e-5 of the result's
// scale; bfloat16 inputs multiplied in float32 and rounded once, 8e-3.
#include "server/engine/products.h"

#include <dirent.h>
#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "server/engine/onednn.h"
#include "tests/lib/torch_check.h"

namespace attnserve {
namespace {

using testing::RelativeError;
const auto Random = testing::RandomTensor;

TEST(ProductsTest, RowBlocksOnHelperThreadsEqualOneGemmAndTheReference) {
  const Products products(at::kCPU, at::kFloat, /*min_piece_flops=*/0, /*widen=*/false);
  const HelperPool pool(2);
  ASSERT_EQ(products.Blocks(pool, 64, 2.0 * 48 * 32, Products::kMinGemmRows), 3);
  Proj proj{Random({32, 48}, 1), Random({32}, 2), nullptr};
  const at::Tensor x = Random({64, 48}, 3);
  at::Tensor one = at::empty({64, 32}), split = at::empty({64, 32});
  products.GemmInto(one, x, proj, SerialParallel());
  products.GemmInto(split, x, proj, pool);
  const at::Tensor want =
      at::addmm(proj.b.to(at::kDouble), x.to(at::kDouble), proj.w.to(at::kDouble).t());
  EXPECT_LE(RelativeError(one, want), 1e-5);
  EXPECT_LE(RelativeError(split, one), 1e-6) << "a row block differs from the single GEMM";
  EXPECT_LE(RelativeError(products.Linear(x, proj, pool), want), 1e-5);
}

TEST(ProductsTest, FewRowsRunAsMatrixVectorProductsWithAndWithoutBias) {
  const Products products(at::kCPU, at::kFloat, 0, false);
  for (const bool bias : {true, false}) {
    Proj proj{Random({16, 24}, 4), bias ? Random({16}, 5) : at::Tensor(), nullptr};
    const at::Tensor x = Random({Products::kGemvRows, 24}, 6);
    at::Tensor want = at::mm(x.to(at::kDouble), proj.w.to(at::kDouble).t());
    if (bias) want += proj.b.to(at::kDouble);
    EXPECT_LE(RelativeError(products.Linear(x, proj, SerialParallel()), want), 1e-5) << bias;
  }
}

TEST(ProductsTest, WidenedBfloat16MultipliesInFloat32AndRoundsOnce) {
  const Products widened(at::kCPU, at::kBFloat16, 0, /*widen=*/true);
  // 512 terms: summed in bfloat16 they would be off by ~4.5e-2 of the scale.
  const at::Tensor a = Random({4, 8, 512}, 7).to(at::kBFloat16);
  const at::Tensor b = Random({4, 512, 8}, 8).to(at::kBFloat16);
  const at::Tensor got = widened.Matmul(a, b);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_LE(RelativeError(got, at::matmul(a.to(at::kDouble), b.to(at::kDouble))), 8e-3);
}

// Float32 with a packed-rows limit (CPUs without AVX-512): up to the limit the products run on the
// packed weights, past it on the BLAS. The packed copy here holds other weights than w, so each
// answer says which ran.
TEST(ProductsTest, SmallFloat32BatchesRunOnPackedWeightsLargerOnTheBlas) {
  const int64_t in = 48, out = 32;
  const at::Tensor w = Random({out, in}, 7), other = Random({out, in}, 8), b = Random({out}, 9);
  Proj proj{w, b,
            std::shared_ptr<const onednn::PackedLinear>(onednn::PackedLinear::Make(
                other.data_ptr<float>(), b.data_ptr<float>(), out, in, onednn::Type::kFloat32))};
  if (!proj.packed) GTEST_SKIP() << "oneDNN packs no float32 kernel on this CPU";
  const Products products(at::kCPU, at::kFloat, 0, false, Products::kSmallPackedRows);
  const auto want = [&](const at::Tensor& x, const at::Tensor& weights) {
    return at::addmm(b.to(at::kDouble), x.to(at::kDouble), weights.to(at::kDouble).t());
  };
  for (const int64_t rows : {Products::kGemvRows + 1, Products::kSmallPackedRows}) {
    const at::Tensor x = Random({rows, in}, 10 + rows);
    EXPECT_LE(RelativeError(products.Linear(x, proj, SerialParallel()), want(x, other)), 1e-5)
        << rows << " rows did not run on the packed weights";
  }
  const at::Tensor x = Random({Products::kSmallPackedRows + 1, in}, 11);
  EXPECT_LE(RelativeError(products.Linear(x, proj, SerialParallel()), want(x, w)), 1e-5)
      << "rows past the limit did not run on the BLAS";
  const Products any_rows(at::kCPU, at::kFloat, 0, false);  // No limit: packed whatever the rows.
  EXPECT_LE(RelativeError(any_rows.Linear(x, proj, SerialParallel()), want(x, other)), 1e-5);
}

// Packed weights are read once for all of a call's rows, GEMVs once a row: on the AVX-512 EPYC
// (Zen 5, one thread) [2560, 2048] and [2048, 2048] at 4 rows took 3.75 ms as GEMVs against 0.91
// packed, at 1 row 0.95 against 0.63. So a few rows run on packed weights where there are: at
// every height without a packed-rows limit (AVX-512), from 2 rows under one (AVX2, where one row's
// GEMV was not measured against them). As above, the packed copy holds other weights than w.
TEST(ProductsTest, AFewRowsRunOnPackedWeightsWhereThereAreAndOneRowOnAGemvUnderALimit) {
  const int64_t in = 48, out = 32;
  const at::Tensor w = Random({out, in}, 12), other = Random({out, in}, 13), b = Random({out}, 14);
  Proj proj{w, b,
            std::shared_ptr<const onednn::PackedLinear>(onednn::PackedLinear::Make(
                other.data_ptr<float>(), b.data_ptr<float>(), out, in, onednn::Type::kFloat32))};
  if (!proj.packed) GTEST_SKIP() << "oneDNN packs no float32 kernel on this CPU";
  const auto want = [&](const at::Tensor& x, const at::Tensor& weights) {
    return at::addmm(b.to(at::kDouble), x.to(at::kDouble), weights.to(at::kDouble).t());
  };
  const Products any_rows(at::kCPU, at::kFloat, 0, false);
  const Products limited(at::kCPU, at::kFloat, 0, false, Products::kSmallPackedRows);
  for (int64_t rows = 1; rows <= Products::kGemvRows; ++rows) {
    const at::Tensor x = Random({rows, in}, 20 + rows);
    EXPECT_LE(RelativeError(any_rows.Linear(x, proj, SerialParallel()), want(x, other)), 1e-5)
        << rows << " rows did not run on the packed weights";
    at::Tensor y = at::empty({rows, out});
    any_rows.GemmInto(y, x, proj, SerialParallel());
    EXPECT_LE(RelativeError(y, want(x, other)), 1e-5) << rows << " rows (GemmInto)";
    EXPECT_LE(
        RelativeError(limited.Linear(x, proj, SerialParallel()), want(x, rows == 1 ? w : other)),
        1e-5)
        << rows << " rows under the limit: " << (rows == 1 ? "not a GEMV" : "not packed");
  }
}

// Output columns [n0, n0 + nn) of packed weights (PackedLinear::RunColumns), the pieces a few rows'
// product is cut into for idle cores: each equal, bit for bit, to those columns of the whole
// product, with and without bias, into dense and wider rows (a buffer in between), the last piece
// ending at n off the column block; misaligned pieces refused, nothing written; and pieces whose
// kernel is not the whole product's (bfloat16 on AMX) refused, nothing written.
TEST(ProductsTest, PackedColumnPiecesEqualTheWholeProductBitForBit) {
  const int64_t in = 96,
                out = 200;  // 200 columns: blocks of 64 (or whatever the layout's) + a tail
  const at::Tensor w = Random({out, in}, 40), b = Random({out}, 41);
  for (const onednn::Type type : {onednn::Type::kFloat32, onednn::Type::kBFloat16}) {
    if (type == onednn::Type::kBFloat16 && !onednn::HasBfloat16Kernels()) continue;
    const at::ScalarType st = type == onednn::Type::kFloat32 ? at::kFloat : at::kBFloat16;
    for (const bool bias : {true, false}) {
      const auto packed = onednn::PackedLinear::Make(
          w.data_ptr<float>(), bias ? b.data_ptr<float>() : nullptr, out, in, type);
      if (!packed) continue;
      const int64_t block = packed->ColumnBlock();
      ASSERT_GT(block, 0);
      if (block == out) {  // A layout not cut by columns (AVX2's "ab"): every part refused.
        ASSERT_FALSE(onednn::HasAvx512Kernels()) << packed->Layout() << " is not cut by columns";
        const at::Tensor x = Random({3, in}, 53).to(st);
        at::Tensor untouched = at::full({3, out}, -7.0f);
        EXPECT_FALSE(packed->RunColumns(x.data_ptr(), 3, in, untouched.data_ptr(),
                                        onednn::Type::kFloat32, out, 0, out / 2));
        EXPECT_TRUE(at::equal(untouched, at::full({3, out}, -7.0f)));
        continue;
      }
      for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{10}}) {
        const at::Tensor x = Random({rows, in}, 50 + rows).to(st);
        at::Tensor whole = at::empty({rows, out});
        ASSERT_TRUE(
            packed->Run(x.data_ptr(), rows, in, whole.data_ptr(), onednn::Type::kFloat32, out));
        for (const int64_t ld : {out, out + 13}) {  // Dense rows, and rows of a wider matrix.
          at::Tensor pieces = at::full({rows, ld}, -7.0f);
          const std::string whole_kernel = packed->Kernel(rows, in, onednn::Type::kFloat32, 0, out);
          ASSERT_FALSE(whole_kernel.empty());
          for (int64_t n0 = 0; n0 < out; n0 += block) {
            const int64_t nn = std::min(block, out - n0);
            const bool alike =
                packed->Kernel(rows, in, onednn::Type::kFloat32, n0, nn) == whole_kernel;
            // The decoding batches' float32 products are cut everywhere; bfloat16 ones where
            // oneDNN's kernel for a piece is the whole's (on AMX, not for a few rows).
            if (type == onednn::Type::kFloat32) ASSERT_TRUE(alike) << n0 << "+" << nn;
            EXPECT_EQ(packed->RunColumns(x.data_ptr(), rows, in, pieces.data_ptr(),
                                         onednn::Type::kFloat32, ld, n0, nn),
                      alike)
                << n0 << "+" << nn << ": refused only where the kernels differ";
            if (alike) continue;
            EXPECT_TRUE(at::equal(pieces.narrow(1, n0, nn), at::full({rows, nn}, -7.0f)))
                << "a refused piece wrote";
            pieces.narrow(1, n0, nn).copy_(whole.narrow(1, n0, nn));
          }
          EXPECT_TRUE(at::equal(pieces.narrow(1, 0, out), whole))
              << "type " << static_cast<int>(type) << " bias " << bias << " rows " << rows << " ld "
              << ld << ": max diff "
              << (pieces.narrow(1, 0, out) - whole).abs().max().item<float>();
          if (ld > out)
            EXPECT_TRUE(
                at::equal(pieces.narrow(1, out, ld - out), at::full({rows, ld - out}, -7.0f)));
        }
        at::Tensor untouched = at::full({rows, out}, -7.0f);
        EXPECT_FALSE(packed->RunColumns(x.data_ptr(), rows, in, untouched.data_ptr(),
                                        onednn::Type::kFloat32, out, 1, block));
        EXPECT_FALSE(packed->RunColumns(x.data_ptr(), rows, in, untouched.data_ptr(),
                                        onednn::Type::kFloat32, out, 0, out + 1));
        EXPECT_TRUE(at::equal(untouched, at::full({rows, out}, -7.0f)));
      }
    }
  }
}

// Two threads' width, the pieces run in turn on the caller; it counts the pieces it was given.
class CountingParallel final : public Parallel {
 public:
  int Width() const override { return 2; }
  void For(int64_t n, const std::function<void(int64_t)>& fn) const override {
    pieces += n;
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
  mutable int64_t pieces = 0;
};

// A few rows with a core idle: GemmInto cuts the output columns (row blocks need kMinGemmRows
// rows each), on helper threads too, and the answer is the serial product's, bit for bit. Not on
// AVX2, whose oneDNN layout ("ab", gemm:jit) is not cut by columns.
TEST(ProductsTest, AFewRowsOnIdleCoresSplitTheColumnsAndEqualTheSerialProduct) {
  const int64_t in = 256, out = 512;
  const at::Tensor w = Random({out, in}, 60), b = Random({out}, 61);
  Proj proj{w, b,
            std::shared_ptr<const onednn::PackedLinear>(onednn::PackedLinear::Make(
                w.data_ptr<float>(), b.data_ptr<float>(), out, in, onednn::Type::kFloat32))};
  if (!proj.packed) GTEST_SKIP() << "oneDNN packs no float32 kernel on this CPU";
  const bool cut = proj.packed->ColumnBlock() < out;
  ASSERT_TRUE(cut || !onednn::HasAvx512Kernels()) << proj.packed->Layout() << " is not cut";
  const Products products(at::kCPU, at::kFloat, /*min_piece_flops=*/0, false);
  const HelperPool pool(2);
  for (const int64_t rows : {int64_t{1}, int64_t{5}, Products::kMinGemmRows + 1}) {
    const at::Tensor x = Random({rows, in}, 70 + rows);
    at::Tensor serial = at::empty({rows, out}), split = at::empty({rows, out}),
               counted = at::empty({rows, out});
    products.GemmInto(serial, x, proj, SerialParallel());
    products.GemmInto(split, x, proj, pool);
    const CountingParallel two;
    products.GemmInto(counted, x, proj, two);
    EXPECT_EQ(two.pieces, cut ? 2 : 0) << rows << " rows, layout " << proj.packed->Layout();
    EXPECT_TRUE(at::equal(split, serial))
        << rows << " rows: max diff " << (split - serial).abs().max().item<float>();
    EXPECT_TRUE(at::equal(counted, serial)) << rows << " rows";
    EXPECT_LE(RelativeError(split,
                            at::addmm(b.to(at::kDouble), x.to(at::kDouble), w.to(at::kDouble).t())),
              1e-5);
  }
}

// The same in bfloat16, 1 to kMinGemmRows rows: the pieces' kernels may not be the whole
// product's (on AMX oneDNN multiplies a few rows of every column on the tiles and 64 columns with
// AVX512-BF16 instructions, which sum in another order), and then the product is not cut: an
// answer never depends on whether a core was idle.
TEST(ProductsTest, ABfloat16FewRowsProductOnIdleCoresIsTheSerialOneBitForBit) {
  if (!onednn::HasBfloat16Kernels()) GTEST_SKIP() << "no bfloat16 kernels on this CPU";
  const int64_t in = 256, out = 512;
  const at::Tensor w = Random({out, in}, 62), b = Random({out}, 63);
  Proj proj{w.to(at::kBFloat16), b.to(at::kBFloat16),
            std::shared_ptr<const onednn::PackedLinear>(onednn::PackedLinear::Make(
                w.data_ptr<float>(), b.data_ptr<float>(), out, in, onednn::Type::kBFloat16))};
  ASSERT_TRUE(proj.packed);
  const Products products(at::kCPU, at::kBFloat16, /*min_piece_flops=*/0, false);
  const HelperPool pool(2);
  for (int64_t rows = 1; rows <= Products::kMinGemmRows; ++rows) {
    const at::Tensor x = Random({rows, in}, 80 + rows).to(at::kBFloat16);
    for (const at::ScalarType yt : {at::kFloat, at::kBFloat16}) {
      at::Tensor serial = at::empty({rows, out}, yt), split = at::empty({rows, out}, yt);
      products.GemmInto(serial, x, proj, SerialParallel());
      products.GemmInto(split, x, proj, pool);
      EXPECT_TRUE(at::equal(split, serial))
          << rows << " rows into " << yt << ": max diff "
          << (split.to(at::kFloat) - serial.to(at::kFloat)).abs().max().item<float>();
    }
  }
}

// The threads of this process now.
int ThreadCount() {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (const dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

// Parallelism is the server's (one worker per core, idle ones helping): a oneDNN product must run
// on the thread that calls it. oneDNN's OpenMP runtime gives a thread that never set its own
// thread count a team of every core, and the engine's workers are such threads: on a 16-core host
// each bfloat16 product of 16 workers fanned out 16 ways. Fails only where there are 2 cores or
// more (CI's machine has 2).
TEST(ProductsTest, OnednnProductsRunOnTheCallingThreadAlone) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: no team to form";
  const int64_t m = 256, k = 512, n = 512;
  std::vector<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n, 0.0f);
  const onednn::View va{a.data(), onednn::Type::kFloat32, {m, k}, {k, 1}};
  const onednn::View vb{b.data(), onednn::Type::kFloat32, {k, n}, {n, 1}};
  const onednn::View vc{c.data(), onednn::Type::kFloat32, {m, n}, {n, 1}};
  int before = 0, after = 0;
  bool ran = false;
  std::thread worker([&] {  // As an engine worker: a thread of the process's own, not OpenMP's.
    before = ThreadCount();
    ran = onednn::Matmul(va, vb, vc, 1.0f);
    after = ThreadCount();
  });
  worker.join();
  ASSERT_TRUE(ran) << "oneDNN has no float32 matmul kernel here";
  EXPECT_FLOAT_EQ(c[0], 0.5f * 0.25f * k);
  EXPECT_EQ(after, before) << "a oneDNN product started " << after - before << " threads";
}

TEST(ProductsTest, PiecesRunEachOnceAndRethrowTheFirstException) {
  const Products products(at::kCPU, at::kFloat, 0, false);
  const HelperPool pool(2);
  std::vector<int> runs(7, 0);
  products.Pieces(pool, 7, [&](int64_t i) { ++runs[static_cast<size_t>(i)]; });
  EXPECT_EQ(runs, std::vector<int>(7, 1));
  EXPECT_THROW(products.Pieces(pool, 5,
                               [](int64_t i) {
                                 if (i == 3) throw std::runtime_error("piece 3");
                               }),
               std::runtime_error);
  for (int64_t blocks : {1, 3, 7}) {  // Blocks tile the rows exactly.
    int64_t next = 0;
    for (int64_t i = 0; i < blocks; ++i) {
      const auto [start, size] = Products::Block(20, blocks, i);
      EXPECT_EQ(start, next);
      next += size;
    }
    EXPECT_EQ(next, 20);
  }
}

}  // namespace
}  // namespace attnserve
