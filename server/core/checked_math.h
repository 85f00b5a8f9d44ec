#pragma once
// Checked int64 arithmetic for sizes that come from a request (tokens, bytes, capacities): a size
// that would overflow is refused, never wrapped into a small or negative number.

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace attnserve {

/// a + b, or nullopt when it overflows int64.
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// The product of `factors`, or nullopt when it overflows int64.
inline std::optional<int64_t> CheckedMul(std::initializer_list<int64_t> factors) {
  int64_t r = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(r, f, &r)) return std::nullopt;
  }
  return r;
}

}  // namespace attnserve
