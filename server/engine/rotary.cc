#include "server/engine/rotary.h"

#include <cmath>

namespace attnserve {

at::Tensor RotaryInverseFrequencies(const RotarySpec& r) {
  // transformers: 1 / theta ** (arange(0, dim, 2) / dim), every step in float32.
  const at::Tensor exponent =
      at::arange(0, r.rotary_dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(r.rotary_dim);
  at::Tensor inv = at::reciprocal(at::pow(r.theta, exponent));
  if (r.type != "llama3") return inv;
  // Llama 3: wavelengths longer than the original context / low_freq_factor are stretched by
  // `factor`, shorter than it / high_freq_factor kept, those between interpolated.
  const double old_len = static_cast<double>(r.original_max_position);
  const double low_wavelen = old_len / r.low_freq_factor,
               high_wavelen = old_len / r.high_freq_factor;
  const at::Tensor wavelen = (2 * M_PI) / inv;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  const at::Tensor smooth =
      (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

namespace {

// Float32 on the CPU, where a loop over the rows does what the ATen ops below do without a dozen
// dispatches a call (a decoding step's rotations were 3.5% of its CPU in a grouped layer's
// steps, bench/RESULTS.md): the same float32 angles, cos and sin within 1 ulp of LibTorch's.
bool CpuFloat(const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; }

Rotation RotationOnCpu(const at::Tensor& positions, const at::Tensor& inv_freq) {
  const int64_t half = inv_freq.size(0), rows = positions.size(0);
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const at::Tensor freq = inv_freq.contiguous();
  Rotation r{at::empty({rows, 1, half}, at::kFloat), at::empty({rows, 1, half}, at::kFloat)};
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* f = freq.data_ptr<float>();
  float *c = r.cos.data_ptr<float>(), *s = r.sin.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) {
    const float at = static_cast<float>(p[i]);
    for (int64_t j = 0; j < half; ++j) {
      const float angle = at * f[j];
      c[i * half + j] = std::cos(angle);
      s[i * half + j] = std::sin(angle);
    }
  }
  return r;
}

void RotateOnCpu(const at::Tensor& heads, const Rotation& rotation) {
  const int64_t rows = heads.size(0), count = heads.size(1), half = rotation.cos.size(-1);
  const int64_t row_stride = heads.stride(0), head_stride = heads.stride(1);
  float* x = heads.data_ptr<float>();
  const float *c = rotation.cos.data_ptr<float>(), *s = rotation.sin.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) {
    const float *ci = c + i * half, *si = s + i * half;
    for (int64_t h = 0; h < count; ++h) {
      float* x1 = x + i * row_stride + h * head_stride;
      float* x2 = x1 + half;
      for (int64_t j = 0; j < half; ++j) {
        const float a = x1[j], b = x2[j];
        x1[j] = a * ci[j] - b * si[j];
        x2[j] = b * ci[j] + a * si[j];
      }
    }
  }
}

}  // namespace

Rotation RotationAt(const at::Tensor& positions, const at::Tensor& inv_freq, at::ScalarType dtype) {
  const int64_t half = inv_freq.size(0), rows = positions.size(0);
  if (dtype == at::kFloat && positions.is_cpu() && CpuFloat(inv_freq))
    return RotationOnCpu(positions, inv_freq);
  // Angles [rows, half] = position · inv_freq in float32 (one rounding, as transformers' matmul of
  // [half, 1] by [1, rows]); cos and sin in float32, then in the heads' dtype.
  const at::Tensor angles =
      positions.to(at::kFloat).view({rows, 1}) * inv_freq.to(positions.device()).view({1, half});
  return {angles.cos().to(dtype).view({rows, 1, half}),
          angles.sin().to(dtype).view({rows, 1, half})};
}

void RotateInPlace(const at::Tensor& heads, const Rotation& rotation) {
  if (CpuFloat(heads) && heads.dim() == 3 && heads.stride(2) == 1 && CpuFloat(rotation.cos) &&
      rotation.cos.is_contiguous() && rotation.sin.is_contiguous()) {
    RotateOnCpu(heads, rotation);
    return;
  }
  const int64_t half = rotation.cos.size(-1);
  const at::Tensor x1 = heads.narrow(-1, 0, half), x2 = heads.narrow(-1, half, half);
  // (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): x * cos + rotate_half(x) * sin.
  const at::Tensor r1 = x1 * rotation.cos - x2 * rotation.sin;
  const at::Tensor r2 = x2 * rotation.cos + x1 * rotation.sin;
  x1.copy_(r1);
  x2.copy_(r2);
}

void RmsNormHeadsInPlace(const at::Tensor& heads, const at::Tensor& weight, double eps) {
  const at::Tensor x = heads.to(at::kFloat);
  const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
  heads.copy_(weight.to(heads.scalar_type()) * normed.to(heads.scalar_type()));
}

void NormRotateInPlace(const at::Tensor& heads, const at::Tensor& norm, double eps,
                       const Rotation& rotation) {
  if (norm.defined()) RmsNormHeadsInPlace(heads, norm, eps);
  if (rotation.cos.defined()) RotateInPlace(heads, rotation);
}

}  // namespace attnserve
