#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "server/core/types.h"

namespace attnserve::testing {

/// Owns bytes for TensorViews in tests.
struct Buffer {
  DType dtype;
  std::vector<int64_t> shape;
  std::string bytes;
  TensorView view() const { return TensorView{dtype, shape, bytes.data(), bytes.size()}; }
};

inline int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

inline Buffer Floats(std::vector<int64_t> shape, const std::vector<float>& v) {
  Buffer b{DType::kFloat32, std::move(shape),
           std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float))};
  return b;
}

inline Buffer Zeros(std::vector<int64_t> shape, DType dtype = DType::kFloat32) {
  const size_t n = static_cast<size_t>(Numel(shape)) * DTypeSize(dtype);
  return Buffer{dtype, std::move(shape), std::string(n, '\0')};
}

inline std::vector<float> RandomFloats(std::mt19937& rng, size_t n, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

}  // namespace attnserve::testing
