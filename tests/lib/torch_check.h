#pragma once
// LibTorch helpers for the engine's unit tests: fresh random tensors of a fixed seed, and the error
// measure every numeric check uses.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace attnserve::testing {

/// Standard normal float32 values of `shape`, the same for the same seed.
inline at::Tensor RandomTensor(std::vector<int64_t> shape, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(shape, at::kFloat);
}

/// max |got - want| / max |want|, in float64.
inline double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor w = want.to(at::kDouble);
  return (got.to(at::kDouble) - w).abs().max().item<double>() / w.abs().max().item<double>();
}

}  // namespace attnserve::testing
