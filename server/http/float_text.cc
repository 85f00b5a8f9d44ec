#include "server/http/float_text.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace attnserve {
namespace {

constexpr int kLowest = -32;  // 10^kLowest .. 10^kHighest cover 10^(8 - e) for every float32.
constexpr int kHighest = 54;

// 10^k as the double nearest it (strtod rounds correctly), k in [kLowest, kHighest].
const double* PowersOfTen() {
  static const auto* table = [] {
    auto* t = new double[kHighest - kLowest + 1];
    for (int k = kLowest; k <= kHighest; ++k)
      t[k - kLowest] = std::strtod(("1e" + std::to_string(k)).c_str(), nullptr);
    return t;
  }();
  return table;
}

char* Copy(char* p, const char* text) {
  const size_t n = std::strlen(text);
  std::memcpy(p, text, n);
  return p + n;
}

// "00" .. "99".
const char* Pairs() {
  static const auto* table = [] {
    auto* t = new char[200];
    for (int i = 0; i < 100; ++i) {
      t[2 * i] = static_cast<char>('0' + i / 10);
      t[2 * i + 1] = static_cast<char>('0' + i % 10);
    }
    return t;
  }();
  return table;
}

}  // namespace

char* WriteFloat32(char* p, float f) {
  if (!std::isfinite(f)) return Copy(p, std::isnan(f) ? "NaN" : f > 0 ? "Infinity" : "-Infinity");
  // Written with fixed-size copies (no branch on the sign, few on the form), which may pass the
  // text's end (never p + kFloat32Room).
  char* t = p;
  t[0] = '-';
  const int s = std::signbit(f) ? 1 : 0;
  const double d = std::fabs(static_cast<double>(f));  // Exact: every float is a double.
  if (d == 0) {
    t[s] = '0';
    return p + s + 1;
  }
  // The decimal exponent e (10^e <= d < 10^(e+1)) from the binary one, then the nine digits as
  // the integer nearest d * 10^(8 - e). The product's error (two roundings of a double, ~1e-7 of
  // a unit in the ninth digit) is far inside the margin nine digits leave: one ninth-digit step
  // is at most 0.17 of a float32 ulp, so the text stays within 0.09 ulp of f.
  uint64_t bits = 0;
  std::memcpy(&bits, &d, 8);
  const int e2 = static_cast<int>(bits >> 52) - 1023;
  int e = (e2 * 1233) >> 12;  // floor(e2 * log10(2)): e itself, or one low.
  const double* pow10 = PowersOfTen() - kLowest;
  e += d * pow10[8 - e] >= 1e9 ? 1 : 0;
  uint32_t n = static_cast<uint32_t>(d * pow10[8 - e] + 0.5);
  if (n >= 1000000000) {  // 999999999.5 and up: the next power of ten.
    n = 100000000;
    ++e;
  }
  // The first digit, and the other eight as bytes of a word (the first of them its lowest byte):
  // stored whole, never read back byte by byte.
  const char* pairs = Pairs();
  const uint32_t low = n % 100000000;
  const uint32_t hi4 = low / 10000, lo4 = low % 10000;
  const auto pair = [pairs](uint32_t k) {
    uint16_t v = 0;
    std::memcpy(&v, pairs + 2 * k, 2);
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
    std::memcpy(t + end + 2, pairs + 2 * std::abs(e), 2);
    end += 4;
  }
  return p + end;
}

}  // namespace attnserve
