// RoPE on its own (server/engine/rotary.h): the CPU float32 rotation (a loop over the rows) against
// float64 of the same float32 angles, on strided views of query rows, a partial rotary dimension
// and positions up to 2^20; the dimensions past the rotated ones untouched; and the same rotation
// through LibTorch's ops (bfloat16 rows, which take them) within bfloat16's rounding. Fresh random
// inputs of fixed seeds; tolerance 1e-6 of the result's scale (cos and sin within 1 ulp).
#include "server/engine/rotary.h"

#include <gtest/gtest.h>

#include "tests/lib/torch_check.h"

namespace attnserve {
namespace {

using testing::RelativeError;
const auto Random = testing::RandomTensor;

// Float64 rotation of x [rows, H, D] at `positions` by angles rounded to float32, as transformers
// computes them; the first 2 * half dims rotated.
at::Tensor Reference(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq) {
  const int64_t half = inv_freq.size(0);
  const at::Tensor angles =
      (positions.to(at::kFloat).view({-1, 1}) * inv_freq.view({1, half})).to(at::kDouble);
  const at::Tensor c = angles.cos().unsqueeze(1), s = angles.sin().unsqueeze(1);
  at::Tensor y = x.to(at::kDouble).clone();
  const at::Tensor x1 = y.narrow(-1, 0, half).clone(), x2 = y.narrow(-1, half, half).clone();
  y.narrow(-1, 0, half).copy_(x1 * c - x2 * s);
  y.narrow(-1, half, half).copy_(x2 * c + x1 * s);
  return y;
}

TEST(RotaryTest, CpuFloat32RowsRotateAsFloat64OfTheSameAngles) {
  RotarySpec spec;
  spec.theta = 10000;
  for (const int64_t rotary_dim : {int64_t{64}, int64_t{32}}) {
    spec.rotary_dim = rotary_dim;
    const at::Tensor inv_freq = RotaryInverseFrequencies(spec);
    const int64_t rows = 5, heads = 3, d = 64, width = heads * d + 40;
    // Query rows of a wider projection's output: row stride past the heads.
    const at::Tensor wide = Random({rows, width}, 30 + rotary_dim);
    at::Tensor x = wide.narrow(1, 0, heads * d).view({rows, heads, d});
    const at::Tensor positions = at::tensor({0L, 1L, 17L, 1023L, 1L << 20}, at::kLong);
    const at::Tensor want = Reference(x, positions, inv_freq);
    const at::Tensor rest = wide.narrow(1, heads * d, 40).clone();
    RotateInPlace(x, RotationAt(positions, inv_freq, at::kFloat));
    EXPECT_LE(RelativeError(x, want), 1e-6) << "rotary_dim " << rotary_dim;
    EXPECT_TRUE(wide.narrow(1, heads * d, 40).equal(rest)) << "wrote past the heads";
    // LibTorch's ops (bfloat16), within its rounding of the same rotation.
    at::Tensor xb = want.to(at::kBFloat16);  // (Any rows: compared with their own reference.)
    const at::Tensor want_b = Reference(xb.to(at::kFloat), positions, inv_freq);
    RotateInPlace(xb, RotationAt(positions, inv_freq, at::kBFloat16));
    EXPECT_LE(RelativeError(xb, want_b), 2e-2) << "bfloat16, rotary_dim " << rotary_dim;
  }
}

}  // namespace
}  // namespace attnserve
