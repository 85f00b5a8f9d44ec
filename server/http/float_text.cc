#include "server/http/float_text.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace attnserve {
namespace {

constexpr int kLowest = -32;  // 10^kLowest .. 10^kHighest cover 10^(8 - e) for every float32.
constexpr int kHighest = 54;

// 10^k as the double nearest it (the compiler rounds each literal correctly), k in
// [kLowest, kHighest].
constexpr double kPowersOfTen[kHighest - kLowest + 1] = {
    1e-32, 1e-31, 1e-30, 1e-29, 1e-28, 1e-27, 1e-26, 1e-25, 1e-24, 1e-23, 1e-22, 1e-21, 1e-20,
    1e-19, 1e-18, 1e-17, 1e-16, 1e-15, 1e-14, 1e-13, 1e-12, 1e-11, 1e-10, 1e-9,  1e-8,  1e-7,
    1e-6,  1e-5,  1e-4,  1e-3,  1e-2,  1e-1,  1e0,   1e1,   1e2,   1e3,   1e4,   1e5,   1e6,
    1e7,   1e8,   1e9,   1e10,  1e11,  1e12,  1e13,  1e14,  1e15,  1e16,  1e17,  1e18,  1e19,
    1e20,  1e21,  1e22,  1e23,  1e24,  1e25,  1e26,  1e27,  1e28,  1e29,  1e30,  1e31,  1e32,
    1e33,  1e34,  1e35,  1e36,  1e37,  1e38,  1e39,  1e40,  1e41,  1e42,  1e43,  1e44,  1e45,
    1e46,  1e47,  1e48,  1e49,  1e50,  1e51,  1e52,  1e53,  1e54};

// "00" .. "99".
constexpr char kPairs[] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

char* Copy(char* p, const char* text) {
  const size_t n = std::strlen(text);
  std::memcpy(p, text, n);
  return p + n;
}

// A finite, nonzero float's nine significant digits as an integer (10^8 <= n < 10^9) and its
// decimal exponent e (10^e <= |f| < 10^(e+1), as rounded to nine digits).
// The exponent comes from the binary one, the digits as the integer nearest |f| * 10^(8 - e).
// The product's error (two roundings of a double, ~1e-7 of a unit in the ninth digit) is far
// inside the margin nine digits leave: one ninth-digit step is at most 0.17 of a float32 ulp,
// so the text stays within 0.09 ulp of f.
struct Digits {
  uint32_t n;
  int e;
};

inline Digits DigitsOf(float f) {
  const double d = std::fabs(static_cast<double>(f));  // Exact: every float is a double.
  uint64_t bits = 0;
  std::memcpy(&bits, &d, 8);
  const int e2 = static_cast<int>(bits >> 52) - 1023;
  int e = (e2 * 1233) >> 12;  // floor(e2 * log10(2)): e itself, or one low.
  const double* pow10 = kPowersOfTen - kLowest;
  e += d * pow10[8 - e] >= 1e9 ? 1 : 0;
  uint32_t n = static_cast<uint32_t>(d * pow10[8 - e] + 0.5);
  if (n >= 1000000000) {  // 999999999.5 and up: the next power of ten.
    n = 100000000;
    ++e;
  }
  return {n, e};
}

// Writes the text of a finite, nonzero float with sign bit `s` and digits `g`.
inline char* Format(char* t, int s, Digits g) {
  // Fixed-size copies (no branch on the sign, few on the form), which may pass the text's end
  // (never t + kFloat32Room).
  t[0] = '-';
  const uint32_t n = g.n;
  const int e = g.e;
  // The first digit, and the other eight as bytes of a word (the first of them its lowest byte):
  // stored whole, never read back byte by byte.
  const uint32_t low = n % 100000000;
  const uint32_t hi4 = low / 10000, lo4 = low % 10000;
  const auto pair = [](uint32_t k) {
    uint16_t v = 0;
    std::memcpy(&v, kPairs + 2 * k, 2);
    return uint64_t{v};
  };
  const char first = static_cast<char>('0' + n / 100000000);
  const uint64_t rest =
      pair(hi4 / 100) | pair(hi4 % 100) << 16 | pair(lo4 / 100) << 32 | pair(lo4 % 100) << 48;
  // Significant digits: nine less the trailing zero bytes of `rest` (the first is never 0).
  const uint64_t zeros = rest ^ 0x3030303030303030ull;
  const int len = 9 - (zeros == 0 ? 64 : __builtin_clzll(zeros)) / 8;
  int end = 0;
  if (e >= -4 && e < 0) {  // 0.000ddd
    std::memcpy(t + s, "0.0000", 6);
    t[s + 1 - e] = first;
    std::memcpy(t + s + 2 - e, &rest, 8);
    end = s + 1 - e + len;
  } else if (e >= 0 && e <= 8) {  // ddd[.ddd]
    t[s] = first;
    std::memcpy(t + s + 1, &rest, 8);
    const uint64_t fraction = e < 8 ? rest >> (8 * e) : 0;  // The digits after the point.
    t[s + e + 1] = '.';
    std::memcpy(t + s + e + 2, &fraction, 8);
    end = s + (len > e + 1 ? len + 1 : e + 1);
  } else {  // d[.ddd]e±XX
    t[s] = first;
    t[s + 1] = '.';
    std::memcpy(t + s + 2, &rest, 8);
    end = s + (len > 1 ? len + 1 : 1);
    t[end] = 'e';
    t[end + 1] = e < 0 ? '-' : '+';
    std::memcpy(t + end + 2, kPairs + 2 * std::abs(e), 2);
    end += 4;
  }
  return t + end;
}

char* Special(char* p, float f) {
  if (std::isnan(f)) return Copy(p, "NaN");
  if (std::isinf(f)) return Copy(p, f > 0 ? "Infinity" : "-Infinity");
  return Copy(p, std::signbit(f) ? "-0" : "0");
}

bool Ordinary(float f) { return std::isfinite(f) && f != 0; }

}  // namespace

char* WriteFloat32(char* p, float f) {
  if (!Ordinary(f)) return Special(p, f);
  return Format(p, std::signbit(f) ? 1 : 0, DigitsOf(f));
}

char* WriteFloat32List(char* p, const void* values, size_t count) {
  const auto* bytes = static_cast<const char*>(values);
  const auto value = [bytes](size_t k) {  // Read where it lies, aligned or not.
    float f = 0;
    std::memcpy(&f, bytes + 4 * k, 4);
    return f;
  };
  // In blocks: the digits of a block first (each independent of the others, so computed side by
  // side), then its text.
  constexpr size_t kBlock = 16;
  Digits g[kBlock];
  for (size_t at = 0; at < count; at += kBlock) {
    const size_t m = std::min(kBlock, count - at);
    for (size_t k = 0; k < m; ++k) g[k] = DigitsOf(Ordinary(value(at + k)) ? value(at + k) : 1.0f);
    for (size_t k = 0; k < m; ++k) {
      *p = ',';
      p += at + k > 0 ? 1 : 0;
      const float f = value(at + k);
      p = Ordinary(f) ? Format(p, std::signbit(f) ? 1 : 0, g[k]) : Special(p, f);
    }
  }
  return p;
}

}  // namespace attnserve
