#include "server/http/float_text.h"

#include <gtest/gtest.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace attnserve {
namespace {

std::string Text(float f) {
  char buf[kFloat32Room];
  char* end = WriteFloat32(buf, f);
  EXPECT_LE(end - buf, kFloat32TextMax);
  return std::string(buf, end);
}

// The text read back with a correctly rounding parser is the same float, bit for bit.
void ExpectRoundTrip(float f) {
  const std::string s = Text(f);
  float back = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), back);
  ASSERT_EQ(r.ec, std::errc()) << s;
  ASSERT_EQ(r.ptr, s.data() + s.size()) << s;
  uint32_t a = 0, b = 0;
  std::memcpy(&a, &f, 4);
  std::memcpy(&b, &back, 4);
  ASSERT_EQ(a, b) << s;
  // What JSON readers that go through double do (nlohmann, Python): the same float too.
  ASSERT_EQ(static_cast<float>(std::strtod(s.c_str(), nullptr)), f) << s;
}

TEST(FloatTextTest, EveryFloatOfASampledSweepReadsBackTheSame) {
  // Every 4001st bit pattern, about a million: all binades, both signs, subnormals.
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 4001) {
    float f = 0;
    const uint32_t b = static_cast<uint32_t>(bits);
    std::memcpy(&f, &b, 4);
    if (!std::isfinite(f)) continue;
    ExpectRoundTrip(f);
  }
  std::mt19937 rng(71);
  std::normal_distribution<float> normal;
  for (int i = 0; i < 200000; ++i) ExpectRoundTrip(normal(rng));
}

TEST(FloatTextTest, EdgesReadBackTheSame) {
  using L = std::numeric_limits<float>;
  for (float f : {0.0f,
                  -0.0f,
                  L::min(),
                  -L::min(),
                  L::denorm_min(),
                  -L::denorm_min(),
                  L::max(),
                  -L::max(),
                  1.0f,
                  -1.0f,
                  0.1f,
                  1e-4f,
                  9.99999997e-5f,
                  1e-5f,
                  1e8f,
                  999999999.0f,
                  1e9f,
                  123456789.0f,
                  9.9999999e8f,
                  0.5f,
                  16777216.0f,
                  16777217.0f,
                  std::nextafter(1.0f, 2.0f),
                  std::nextafter(1.0f, 0.0f),
                  3.4028235e38f,
                  1.17549421e-38f,
                  9.999999e37f}) {
    ExpectRoundTrip(f);
  }
  for (int k = -45; k <= 38; ++k) {  // Each power of ten and its neighbours.
    const float p = std::strtof(("1e" + std::to_string(k)).c_str(), nullptr);
    ExpectRoundTrip(p);
    ExpectRoundTrip(std::nextafter(p, 0.0f));
    ExpectRoundTrip(std::nextafter(p, L::infinity()));
  }
}

TEST(FloatTextTest, RoundValuesStayShortAndPlain) {
  EXPECT_EQ(Text(0.0f), "0");
  EXPECT_EQ(Text(-0.0f), "-0");
  EXPECT_EQ(Text(1.0f), "1");
  EXPECT_EQ(Text(-2.5f), "-2.5");
  EXPECT_EQ(Text(100.0f), "100");
  EXPECT_EQ(Text(0.5f), "0.5");
  EXPECT_EQ(Text(0.001953125f), "0.001953125");
  EXPECT_EQ(Text(0.000030517578125f), "3.05175781e-05");  // 2^-15, rounded to nine digits.
  EXPECT_EQ(Text(1e-5f), "9.99999975e-06");
  EXPECT_EQ(Text(1e9f), "1e+09");
  EXPECT_EQ(Text(0.1f), "0.100000001");  // Nine digits: float32's 0.1 is 0.100000001490116...
  EXPECT_EQ(Text(std::numeric_limits<float>::max()), "3.40282347e+38");
  EXPECT_EQ(Text(std::numeric_limits<float>::denorm_min()), "1.40129846e-45");
}

// The list writer (blocks of digits computed side by side) writes what WriteFloat32 writes, comma
// separated, across its blocks' edges, with NaN, infinities and zeros among the numbers.
TEST(FloatTextTest, AListIsEachNumbersTextJoinedByCommas) {
  std::mt19937 rng(72);
  std::normal_distribution<float> normal;
  std::vector<float> values;
  for (int i = 0; i < 1000; ++i) values.push_back(normal(rng) * std::pow(10.0f, i % 13 - 6));
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(),
                            1e9f};
  for (size_t i = 0; i < std::size(specials); ++i) values[i * 17 + 3] = specials[i];
  for (size_t count : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, values.size()}) {
    std::string want;
    for (size_t i = 0; i < count; ++i) want += (i ? "," : "") + Text(values[i]);
    std::string got(count * (kFloat32TextMax + 1) + kFloat32Room, '\0');
    char* end = WriteFloat32List(got.data(), values.data(), count);
    got.resize(static_cast<size_t>(end - got.data()));
    EXPECT_EQ(got, want) << count;
    // The same values where an answer's bytes may lie: not aligned to a float.
    std::string shifted(1 + count * 4, '\0');
    std::memcpy(shifted.data() + 1, values.data(), count * 4);
    std::string unaligned(got.size() + kFloat32Room, '\0');
    end = WriteFloat32List(unaligned.data(), shifted.data() + 1, count);
    unaligned.resize(static_cast<size_t>(end - unaligned.data()));
    EXPECT_EQ(unaligned, want) << count;
  }
}

TEST(FloatTextTest, NotNumbersAsPythonWritesThem) {
  EXPECT_EQ(Text(std::numeric_limits<float>::quiet_NaN()), "NaN");
  EXPECT_EQ(Text(std::numeric_limits<float>::infinity()), "Infinity");
  EXPECT_EQ(Text(-std::numeric_limits<float>::infinity()), "-Infinity");
}

}  // namespace
}  // namespace attnserve
