#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "server/core/types.h"

namespace attnserve::testing {

/// Whether this build runs under AddressSanitizer or ThreadSanitizer (tools/sanitize.sh).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

/// How many of a test's `n` repetitions to run: all of them in a plain build; under
/// AddressSanitizer or ThreadSanitizer (tools/sanitize.sh), whose instrumentation makes each 5 to
/// 20 times slower, `n / divisor` (at least 1). For tests whose length is their repetitions: the
/// sanitizers look for races and bad accesses, which the first repetitions already drive through
/// every path; the plain build (ctest) runs them all (docs/tests.md, "How long it takes").
constexpr int Repetitions(int n, int divisor) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return std::max(1, n / divisor);
#else
  (void)divisor;
  return n;
#endif
}

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

/// max |a - b| over two float32 byte strings of the same size (infinity when the sizes differ).
inline double MaxAbsDiff(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  const float* x = reinterpret_cast<const float*>(a.data());
  const float* y = reinterpret_cast<const float*>(b.data());
  double m = 0;
  for (size_t i = 0; i < a.size() / 4; ++i)
    m = std::max(m, std::fabs(static_cast<double>(x[i]) - static_cast<double>(y[i])));
  return m;
}

/// max |a| over float32 bytes.
inline double MaxAbs(const std::string& a) {
  const float* x = reinterpret_cast<const float*>(a.data());
  double m = 0;
  for (size_t i = 0; i < a.size() / 4; ++i) m = std::max(m, std::fabs(static_cast<double>(x[i])));
  return m;
}

}  // namespace attnserve::testing
