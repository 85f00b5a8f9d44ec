// small_attention's kernels on their own (server/engine/small_attention.h): scores and
// probabilities times values for a few query rows a head, with strided rows, key counts that are
// and are not multiples of 8, head dims of one to 33 vectors, and accumulation over pieces, against
// float64 with fresh random inputs of fixed seeds (tolerance 1e-5 of the result's scale), through
// each instruction set the CPU has (AVX2; AVX-512 too where it has that); and the shapes they
// refuse, which they leave untouched.
#include "server/engine/small_attention.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tests/lib/torch_check.h"

namespace attnserve {
namespace {

using testing::RelativeError;
const auto Random = testing::RandomTensor;

TEST(SmallAttentionTest, RunsWhereTheCpuHasAvx2AndFma) {
  EXPECT_EQ(small_attention::Available(),
            __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
  EXPECT_EQ(
      small_attention::Best() == small_attention::Isa::kAvx512,
      static_cast<bool>(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl")));
}

// The instruction sets this CPU runs, best last.
std::vector<small_attention::Isa> IsasHere() {
  std::vector<small_attention::Isa> isas;
  for (const auto isa : {small_attention::Isa::kAvx2, small_attention::Isa::kAvx512}) {
    if (static_cast<int>(isa) <= static_cast<int>(small_attention::Best())) isas.push_back(isa);
  }
  return isas;
}

TEST(SmallAttentionTest, AnInstructionSetTheCpuLacksIsRefusedUntouched) {
  std::vector<small_attention::Isa> lacking = {small_attention::Isa::kNone};
  if (small_attention::Best() != small_attention::Isa::kAvx512) {
    lacking.push_back(small_attention::Isa::kAvx512);
  }
  at::Tensor o = at::full({2, 8}, 7.0f), s = at::full({2, 3}, 7.0f);
  const at::Tensor p = Random({2, 3}, 3), v = Random({3, 8}, 4), q = Random({2, 8}, 5);
  for (const small_attention::Isa isa : lacking) {
    EXPECT_FALSE(small_attention::TimesValues(p.data_ptr<float>(), 3, 2, v.data_ptr<float>(), 8, 3,
                                              8, o.data_ptr<float>(), 8, false, isa));
    EXPECT_FALSE(small_attention::Scores(q.data_ptr<float>(), 8, 2, v.data_ptr<float>(), 8, 3, 8,
                                         1.0f, s.data_ptr<float>(), 3, isa));
  }
  EXPECT_EQ(o.ne(7.0f).sum().item<int64_t>(), 0);
  EXPECT_EQ(s.ne(7.0f).sum().item<int64_t>(), 0);
}

// Scores and values of [m, d] query rows over n keys through `isa`, against float64.
void CheckProducts(int64_t m, int64_t d, int64_t n, small_attention::Isa isa, uint64_t seed) {
  // Rows wider than they are read (strides past d and n), as kept blocks and score rows lie.
  const at::Tensor q = Random({m, d + 8}, seed * 3).narrow(1, 0, d);
  const at::Tensor k = Random({n, d + 16}, seed * 3 + 1).narrow(1, 0, d);
  const at::Tensor v = Random({n, d + 24}, seed * 3 + 2).narrow(1, 0, d);
  const float scale = 0.125f;
  at::Tensor s = at::full({m, n + 5}, 7.0f).narrow(1, 0, n);
  ASSERT_TRUE(small_attention::Scores(q.data_ptr<float>(), q.stride(0), m, k.data_ptr<float>(),
                                      k.stride(0), n, d, scale, s.data_ptr<float>(), s.stride(0),
                                      isa));
  const at::Tensor want_s = at::matmul(q.to(at::kDouble), k.to(at::kDouble).t()) * scale;
  EXPECT_LE(RelativeError(s, want_s), 1e-5) << "scores m " << m << " d " << d << " n " << n;

  const at::Tensor p = at::softmax(s, -1).contiguous();
  // Outputs past d must stay 7: the tails are masked.
  at::Tensor wide = at::full({m, d + 3}, 7.0f);
  at::Tensor o = wide.narrow(1, 0, d);
  ASSERT_TRUE(small_attention::TimesValues(p.data_ptr<float>(), p.stride(0), m, v.data_ptr<float>(),
                                           v.stride(0), n, d, o.data_ptr<float>(), wide.stride(0),
                                           false, isa));
  const at::Tensor want_o = at::matmul(p.to(at::kDouble), v.to(at::kDouble));
  EXPECT_LE(RelativeError(o, want_o), 1e-5) << "values m " << m << " d " << d << " n " << n;
  // Accumulated: o + p · v, as a second piece of keys adds its share.
  ASSERT_TRUE(small_attention::TimesValues(p.data_ptr<float>(), p.stride(0), m, v.data_ptr<float>(),
                                           v.stride(0), n, d, o.data_ptr<float>(), wide.stride(0),
                                           true, isa));
  EXPECT_LE(RelativeError(o, want_o * 2), 1e-5) << "accumulated m " << m << " d " << d;
  EXPECT_EQ(wide.narrow(1, d, 3).ne(7.0f).sum().item<int64_t>(), 0) << "m " << m << " d " << d;
}

TEST(SmallAttentionTest, ScoresAndValuesOfStridedRowsEqualFloat64) {
  if (!small_attention::Available()) {
    // Nothing to compare: the kernels must then refuse every shape, untouched.
    at::Tensor s = at::zeros({2, 8});
    const at::Tensor q = Random({2, 8}, 1), k = Random({8, 8}, 2);
    EXPECT_FALSE(small_attention::Scores(q.data_ptr<float>(), 8, 2, k.data_ptr<float>(), 8, 8, 8,
                                         1.0f, s.data_ptr<float>(), 8));
    EXPECT_EQ(s.abs().max().item<float>(), 0.0f);
    return;
  }
  for (const small_attention::Isa isa : IsasHere()) {
    SCOPED_TRACE("isa " + std::to_string(static_cast<int>(isa)));
    uint64_t seed = 100;
    for (const int64_t m : {2, 3, 5, 8, 15, 16}) {
      for (const int64_t d : {8, 16, 24, 64, 72, 80, 128, 136, 264}) {
        for (const int64_t n : {1, 7, 8, 9, 67, 1121}) CheckProducts(m, d, n, isa, seed++);
      }
    }
  }
}

TEST(SmallAttentionTest, NoKeysGiveZeroValuesAndOtherShapesAreRefusedUntouched) {
  at::Tensor o = at::full({2, 8}, 7.0f);
  const at::Tensor p = at::empty({2, 1}), v = at::empty({1, 8});
  // (Without AVX2 and FMA every shape is refused: o stays 7.)
  EXPECT_EQ(small_attention::TimesValues(p.data_ptr<float>(), 1, 2, v.data_ptr<float>(), 8, 0, 8,
                                         o.data_ptr<float>(), 8, false),
            small_attention::Available());
  EXPECT_EQ(o.abs().max().item<float>(), small_attention::Available() ? 0.0f : 7.0f);
  for (const small_attention::Isa isa : IsasHere()) {  // Each kernel's zeros.
    o.fill_(7.0f);
    EXPECT_TRUE(small_attention::TimesValues(p.data_ptr<float>(), 1, 2, v.data_ptr<float>(), 8, 0,
                                             8, o.data_ptr<float>(), 8, false, isa));
    EXPECT_EQ(o.abs().max().item<float>(), 0.0f) << static_cast<int>(isa);
  }

  const at::Tensor q = Random({17, 12}, 5), k = Random({9, 12}, 6);
  at::Tensor s = at::full({17, 9}, 7.0f);
  // One row (oneDNN's), more than kMaxRows, a head dim not a multiple of 8.
  EXPECT_FALSE(small_attention::Scores(q.data_ptr<float>(), 12, 1, k.data_ptr<float>(), 12, 9, 8,
                                       1.0f, s.data_ptr<float>(), 9));
  EXPECT_FALSE(small_attention::Scores(q.data_ptr<float>(), 12, 17, k.data_ptr<float>(), 12, 9, 8,
                                       1.0f, s.data_ptr<float>(), 9));
  EXPECT_FALSE(small_attention::Scores(q.data_ptr<float>(), 12, 2, k.data_ptr<float>(), 12, 9, 12,
                                       1.0f, s.data_ptr<float>(), 9));
  EXPECT_FALSE(small_attention::TimesValues(s.data_ptr<float>(), 9, 17, k.data_ptr<float>(), 12, 9,
                                            8, o.data_ptr<float>(), 8, false));
  EXPECT_EQ(s.ne(7.0f).sum().item<int64_t>(), 0);
  EXPECT_EQ(o.abs().max().item<float>(), small_attention::Available() ? 0.0f : 7.0f);
}

// The softmax against LibTorch's in float64: rows at a stride, lengths around the 16-lane vector,
// scores spread over ±30 (exps down to e^-60), a few keys masked with -inf (exactly 0), and the
// rows LibTorch makes NaN (a NaN score, a largest score of +inf, every score -inf). Tolerance
// 5e-7 of the row's largest probability (float32's exp and sum; 1.6e-7 measured). Each kernel this
// CPU runs (AVX2's eight lanes, AVX-512's sixteen: lengths around both); one it lacks, or kNone:
// refused, untouched.
TEST(SmallAttentionTest, SoftmaxEqualsLibTorchsNaNRowsAndMaskedKeysIncluded) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const small_attention::Isa isa :
       {small_attention::Isa::kAvx2, small_attention::Isa::kAvx512})
    for (const int64_t n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 1121}) {
      const int64_t m = 7, lds = n + 5;
      at::Tensor wide = Random({m, lds}, 200 + n) * 10.0;
      at::Tensor s = wide.narrow(1, 0, n);
      if (n > 2) {
        s[0][n / 2] = -inf;
        s[1][0] = -inf;
      }
      s[4][n - 1] = std::numeric_limits<float>::quiet_NaN();
      s[5][0] = inf;
      s[6].fill_(-inf);
      const at::Tensor want = at::softmax(s.to(at::kDouble), -1);
      const at::Tensor pad = wide.narrow(1, n, 5).clone();
      const bool ran = small_attention::Softmax(s.data_ptr<float>(), lds, m, n, isa);
      ASSERT_EQ(ran, static_cast<int>(isa) <= static_cast<int>(small_attention::Best()));
      EXPECT_TRUE(wide.narrow(1, n, 5).equal(pad)) << "n " << n << ": wrote past a row";
      if (!ran) continue;
      for (int64_t i = 0; i < 4; ++i) {  // The finite rows.
        EXPECT_LE(RelativeError(s[i], want[i]), 5e-7) << "n " << n << " row " << i;
        EXPECT_EQ(s[i].isnan().sum().item<int64_t>(), 0);
      }
      if (n > 2) {
        EXPECT_EQ(s[0][n / 2].item<float>(), 0.0f);
        EXPECT_EQ(s[1][0].item<float>(), 0.0f);
      }
      for (int64_t i = 4; i < m; ++i) {  // LibTorch's NaN rows.
        EXPECT_EQ(want[i].isnan().sum().item<int64_t>(), n) << "row " << i;
        EXPECT_EQ(s[i].isnan().sum().item<int64_t>(), n) << "n " << n << " row " << i;
      }
    }
  at::Tensor s = at::full({2, 4}, 7.0f);
  EXPECT_FALSE(small_attention::Softmax(s.data_ptr<float>(), 4, 2, 4, small_attention::Isa::kNone));
  EXPECT_FALSE(small_attention::Softmax(s.data_ptr<float>(), 4, 2, 0));
  EXPECT_EQ(s.ne(7.0f).sum().item<int64_t>(), 0);
}

// Rounding to bfloat16 is LibTorch's, bit for bit: random values of every magnitude, the ties
// either way, ±0, ±inf, subnormals, the largest floats (which round to inf) and NaN (0x7fc0, as
// LibTorch's own rounding of one value), at lengths with and without a tail of 16. The softmax
// written in bfloat16 is the float32 softmax then LibTorch's conversion, bit for bit, its NaN rows
// included. Elsewhere than AVX-512: refused, nothing written.
float FloatOfBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

TEST(SmallAttentionTest, RoundingToBfloat16IsLibTorchsBitForBit) {
  const bool avx512 = small_attention::Best() == small_attention::Isa::kAvx512;
  const float inf = std::numeric_limits<float>::infinity();
  for (const int64_t n : {1, 15, 16, 17, 1000}) {
    at::Tensor x = Random({n}, 300 + n) * at::pow(2.0, Random({n}, 400 + n) * 40).to(at::kFloat);
    const std::vector<float> special{0.0f,
                                     -0.0f,
                                     inf,
                                     -inf,
                                     1e-40f,
                                     -3e-39f,
                                     std::numeric_limits<float>::max(),
                                     FloatOfBits(0x3f808000u),  // a tie: to even, down
                                     FloatOfBits(0x3f818000u),  // a tie: to even, up
                                     std::numeric_limits<float>::quiet_NaN()};
    for (int64_t i = 0; i < n && i < static_cast<int64_t>(special.size()); ++i)
      x[i] = special[static_cast<size_t>(i)];
    std::vector<uint16_t> got(static_cast<size_t>(n) + 1, 0xabcd);
    ASSERT_EQ(small_attention::ToBfloat16(x.data_ptr<float>(), n, got.data()), avx512);
    EXPECT_EQ(got[static_cast<size_t>(n)], 0xabcd) << "n " << n << ": wrote past the end";
    if (!avx512) continue;
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i].item<float>();
      EXPECT_EQ(got[static_cast<size_t>(i)], c10::BFloat16(v).x) << "n " << n << " x " << v;
    }
    // LibTorch's vectorised rounding of the whole tensor too (its NaN is another pattern).
    const at::Tensor want = x.to(at::kBFloat16), nan = want.isnan();
    const at::Tensor mine = at::from_blob(got.data(), {n}, at::kBFloat16);
    EXPECT_TRUE(at::equal(mine.isnan(), nan)) << "n " << n;
    EXPECT_TRUE(at::equal(mine.view(at::kShort).masked_select(~nan),
                          want.view(at::kShort).masked_select(~nan)))
        << "n " << n;
  }
  for (const int64_t n : {1, 17, 1121}) {
    const int64_t m = 5, lds = n + 3, ldo = n + 2;
    at::Tensor s = Random({m, lds}, 500 + n) * 10.0;
    if (n > 2) s[1][0] = -inf;
    s[3][n - 1] = std::numeric_limits<float>::quiet_NaN();
    s[4].fill_(-inf);
    at::Tensor want = s.clone();
    const bool plain =
        small_attention::Softmax(want.data_ptr<float>(), lds, m, n, small_attention::Isa::kAvx512);
    at::Tensor out = at::full({m, ldo}, 1.5).to(at::kBFloat16);
    ASSERT_EQ(small_attention::SoftmaxToBfloat16(s.data_ptr<float>(), lds, m, n,
                                                 reinterpret_cast<uint16_t*>(out.data_ptr()), ldo),
              avx512);
    ASSERT_EQ(plain, avx512);
    EXPECT_EQ(out.narrow(1, n, ldo - n).ne(1.5).sum().item<int64_t>(), 0) << "wrote past a row";
    if (!avx512) continue;
    const at::Tensor rounded = want.narrow(1, 0, n).to(at::kBFloat16), got = out.narrow(1, 0, n);
    for (int64_t i = 0; i < 3; ++i)
      EXPECT_TRUE(at::equal(got[i], rounded[i])) << "n " << n << " row " << i;
    for (int64_t i = 3; i < m; ++i) {
      EXPECT_EQ(got[i].isnan().sum().item<int64_t>(), n) << "n " << n << " row " << i;
    }
  }
  float x = 1.0f;
  uint16_t y = 7;
  EXPECT_FALSE(small_attention::ToBfloat16(&x, 1, &y, small_attention::Isa::kAvx2));
  EXPECT_FALSE(small_attention::SoftmaxToBfloat16(&x, 1, 1, 1, &y, 1, small_attention::Isa::kAvx2));
  EXPECT_EQ(y, 7);
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// The values kernels take rows in groups (AVX2: three, then the last one or two; AVX-512: four,
// then two, then one): whatever the grouping, every output row is the one it gets in a pair of
// rows (each output summed over the keys in one order), so a session's answer does not depend on
// how many query rows share its call.
TEST(SmallAttentionTest, ValuesOfManyRowsEqualThemInPairsToTheBit) {
  if (!small_attention::Available()) GTEST_SKIP() << "no AVX2 kernels on this CPU";
  for (const small_attention::Isa isa : IsasHere()) {
    uint64_t seed = 900;
    for (const int64_t m : {2, 3, 4, 5, 7, 8, 9, 12, 13, 16}) {
      for (const int64_t d : {8, 64, 72, 128}) {
        for (const int64_t n : {5, 67, 300}) {
          const at::Tensor p = at::softmax(Random({m, n}, seed++), -1).contiguous();
          const at::Tensor v = Random({n, d}, seed++);
          for (const bool accumulate : {false, true}) {
            const at::Tensor start = Random({m, d}, seed++);
            at::Tensor all = start.clone();
            ASSERT_TRUE(small_attention::TimesValues(p.data_ptr<float>(), n, m, v.data_ptr<float>(),
                                                     d, n, d, all.data_ptr<float>(), d, accumulate,
                                                     isa));
            for (int64_t i = 0; i < m; ++i) {
              const int64_t first = i + 1 < m ? i : i - 1;  // The pair holding row i.
              at::Tensor pair = start.narrow(0, first, 2).clone();
              ASSERT_TRUE(small_attention::TimesValues(p[first].data_ptr<float>(), n, 2,
                                                       v.data_ptr<float>(), d, n, d,
                                                       pair.data_ptr<float>(), d, accumulate, isa));
              EXPECT_TRUE(at::equal(all[i], pair[i - first]))
                  << "isa " << static_cast<int>(isa) << " m " << m << " row " << i << " d " << d
                  << " n " << n;
            }
          }
        }
      }
    }
  }
}

// A row's scores are its own, to the bit, whatever the other rows of its call hold: the kernels
// block rows (three against four keys; eight as lanes in pairs of dims from five rows on; AVX-512
// eight a pass), and no row's sums may take another's, nor change with them. (Which kernel a call
// takes depends on its number of rows, so rows are compared in calls of the same number.)
TEST(SmallAttentionTest, EachRowsScoresAreItsOwnWhateverTheOtherRowsHold) {
  if (!small_attention::Available()) GTEST_SKIP() << "no AVX2 kernels on this CPU";
  for (const small_attention::Isa isa : IsasHere()) {
    uint64_t seed = 1900;
    for (const int64_t m : {2, 3, 4, 5, 7, 8, 9, 16}) {
      for (const int64_t d : {8, 64, 72, 264}) {
        for (const int64_t n : {3, 5, 67, 300}) {
          const at::Tensor q = Random({m, d}, seed++), k = Random({n, d}, seed++);
          at::Tensor all = at::empty({m, n});
          ASSERT_TRUE(small_attention::Scores(q.data_ptr<float>(), d, m, k.data_ptr<float>(), d, n,
                                              d, 0.125f, all.data_ptr<float>(), n, isa));
          for (int64_t i = 0; i < m; ++i) {
            at::Tensor others = Random({m, d}, seed++);  // Row i kept, every other row new.
            others[i].copy_(q[i]);
            at::Tensor again = at::empty({m, n});
            ASSERT_TRUE(small_attention::Scores(others.data_ptr<float>(), d, m, k.data_ptr<float>(),
                                                d, n, d, 0.125f, again.data_ptr<float>(), n, isa));
            EXPECT_TRUE(at::equal(all[i], again[i]))
                << "isa " << static_cast<int>(isa) << " m " << m << " row " << i << " d " << d
                << " n " << n;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attnserve
