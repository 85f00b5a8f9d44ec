#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace attnserve {

/// IEEE-754 binary16 bits to float (exact). Thread-safe.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // Subnormal: normalize.
      exp = 113;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// bfloat16 bits to float (exact). Thread-safe.
inline float BFloat16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// float to IEEE-754 binary16 bits, rounded to nearest even (overflow to infinity, NaN stays
/// NaN). Thread-safe.
inline uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000)
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
  if (abs >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // Overflow to inf.
  if (abs < 0x38800000) {  // Subnormal or zero in half precision.
    const int shift = 113 - static_cast<int>(abs >> 23);
    if (shift > 24) return static_cast<uint16_t>(sign);
    const uint32_t mant = (abs & 0x7fffff) | 0x800000;
    uint32_t half = mant >> (shift + 13);
    const uint32_t rem = mant & ((1u << (shift + 13)) - 1);
    const uint32_t mid = 1u << (shift + 12);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs - 0x38000000) >> 13);
  const uint32_t rem = abs & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return static_cast<uint16_t>(sign | half);
}

/// float to bfloat16 bits, rounded to nearest even on the 16 bits dropped; a NaN keeps a mantissa
/// bit (stays NaN). Thread-safe.
inline uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return std::isnan(f) ? static_cast<uint16_t>((bits >> 16) | 0x40)
                       : static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

}  // namespace attnserve
