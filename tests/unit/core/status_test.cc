// Status: messages are capped, and whatever is cut or carried stays valid UTF-8, since every
// message ends up in a proto3 string (Error.message of a stream's or a batched step's answer),
// which a receiver refuses whole when it is not: one entry's long message took down every entry's
// answer.
#include "server/core/status.h"

#include <gtest/gtest.h>

#include <string>

namespace attnserve {
namespace {

// RFC 3629's well-formed UTF-8 (no overlong forms, no surrogates, nothing past U+10FFFF).
bool ValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size() || (n == 2 && c < 0xC2)) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    const auto c1 = n > 1 ? static_cast<unsigned char>(s[i + 1]) : 0;
    if ((n == 3 && c == 0xE0 && c1 < 0xA0) || (n == 3 && c == 0xED && c1 >= 0xA0) ||
        (n == 4 && c == 0xF0 && c1 < 0x90) || (n == 4 && (c > 0xF4 || (c == 0xF4 && c1 >= 0x90))))
      return false;
    i += n;
  }
  return true;
}

TEST(StatusTest, ACappedMessageIsCutBetweenCharacters) {
  const std::string euro = "\xE2\x82\xAC";  // 3 bytes
  for (int pad = 0; pad < 4; ++pad) {
    std::string m = std::string(static_cast<size_t>(pad), 'x');
    for (int i = 0; i < 400; ++i) m += euro;
    const Status st(StatusCode::kNotFound, m);
    EXPECT_LE(st.message().size(), kMaxStatusMessage) << pad;
    EXPECT_TRUE(ValidUtf8(st.message())) << "pad " << pad;
    EXPECT_EQ(st.message().substr(st.message().size() - 3), "...");
  }
}

TEST(StatusTest, BytesThatAreNotUtf8AreReplaced) {
  const Status st(
      StatusCode::kInvalidArgument,
      std::string("file '/m/\xFF\xFE.pt': \xC0\xAF overlong, \xED\xA0\x80 surrogate, ") +
          "\xE2\x82 cut, ok \xE2\x82\xAC");
  EXPECT_TRUE(ValidUtf8(st.message())) << st.message();
  EXPECT_NE(st.message().find("ok \xE2\x82\xAC"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("file '/m/"), std::string::npos);
  const Status plain(StatusCode::kInternal, "nothing to change");
  EXPECT_EQ(plain.message(), "nothing to change");
}

}  // namespace
}  // namespace attnserve
