#include "server/core/validator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "tests/lib/test_util.h"

namespace attnserve {
namespace {

using testing::Buffer;
using ::testing::HasSubstr;
using testing::Zeros;

ModelSpec Model(int64_t e = 16, int64_t h = 4, int64_t kdim = 16, int64_t vdim = 16) {
  ModelSpec m;
  m.name = "m";
  m.embed_dim = e;
  m.num_heads = h;
  m.kdim = kdim;
  m.vdim = vdim;
  return m;
}

// Keeps the buffers alive beside the call that views them.
struct Call {
  std::vector<Buffer> keep;
  AttendCall call;
  TensorView Add(Buffer b) {
    keep.push_back(std::move(b));
    return keep.back().view();
  }
};

Call SelfCall(std::vector<int64_t> q_shape) {
  Call c;
  c.keep.reserve(8);
  c.call.query = c.Add(Zeros(std::move(q_shape)));
  return c;
}

Call CrossCall(std::vector<int64_t> q, std::vector<int64_t> k, std::vector<int64_t> v) {
  Call c = SelfCall(std::move(q));
  c.call.key = c.Add(Zeros(std::move(k)));
  c.call.value = c.Add(Zeros(std::move(v)));
  return c;
}

Status Check(Call& c, const ModelSpec& m = Model(), AttendLimits limits = {}) {
  return Validate(m, limits, &c.call);
}

// CreateMemory has key and value but no query: the key sets batch, length and dtype.
TEST(ValidatorTest, CreateMemoryTakesItsShapeAndDtypeFromTheKey) {
  Call c;
  c.keep.reserve(4);
  c.call.key = c.Add(Zeros({2, 7, 16}));
  c.call.value = c.Add(Zeros({2, 7, 16}));
  ASSERT_TRUE(ValidateCreateMemory(Model(), {}, &c.call).ok());
  EXPECT_EQ(c.call.batch, 2);
  EXPECT_EQ(c.call.key_len, 7);
  EXPECT_EQ(c.call.query_len, 0);
  Call d;
  d.keep.reserve(4);
  d.call.key = d.Add(Zeros({2, 7, 16}));
  d.call.value = d.Add(Zeros({2, 7, 16}, DType::kFloat16));
  const Status st = ValidateCreateMemory(Model(), {}, &d.call);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(),
              HasSubstr("value: dtype float16 differs from the key's float32; key and value"));
}

TEST(ValidatorTest, AcceptsSelfAttentionAndFillsDims) {
  Call c = SelfCall({2, 5, 16});
  ASSERT_TRUE(Check(c).ok());
  EXPECT_TRUE(c.call.batched);
  EXPECT_EQ(c.call.batch, 2);
  EXPECT_EQ(c.call.query_len, 5);
  EXPECT_EQ(c.call.key_len, 5);
}

TEST(ValidatorTest, ReadsSequenceFirstLayout) {
  Call c = CrossCall({5, 2, 16}, {7, 2, 16}, {7, 2, 16});
  c.call.layout = TensorLayout::kSequenceFirst;
  ASSERT_TRUE(Check(c).ok()) << Check(c).message();
  EXPECT_EQ(c.call.batch, 2);
  EXPECT_EQ(c.call.query_len, 5);
  EXPECT_EQ(c.call.key_len, 7);
}

TEST(ValidatorTest, AcceptsUnbatched) {
  Call c = CrossCall({5, 16}, {3, 16}, {3, 16});
  ASSERT_TRUE(Check(c).ok());
  EXPECT_FALSE(c.call.batched);
  EXPECT_EQ(c.call.batch, 1);
  EXPECT_EQ(c.call.key_len, 3);
}

TEST(ValidatorTest, RejectsWrongQueryRank) {
  Call c = SelfCall({2, 5, 16, 1});
  Status s = Check(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(
      s.message(),
      HasSubstr(
          "query: shape [2, 5, 16, 1] has 4 dims, expected [batch, query_len, embed_dim=16]"));
}

TEST(ValidatorTest, RejectsWrongKeyRank) {
  Call c = CrossCall({2, 5, 16}, {2, 7}, {2, 7, 16});
  EXPECT_THAT(Check(c).message(),
              HasSubstr("key: shape [2, 7] has 2 dims, expected [batch=2, key_len, kdim=16]"));
}

TEST(ValidatorTest, RejectsEmbedDimMismatch) {
  Call c = SelfCall({2, 5, 12});
  EXPECT_THAT(Check(c).message(), HasSubstr("query: shape [2, 5, 12] has embed_dim=12, expected"));
}

TEST(ValidatorTest, RejectsKdimMismatch) {
  Call c = CrossCall({2, 5, 16}, {2, 7, 8}, {2, 7, 16});
  EXPECT_THAT(Check(c).message(), HasSubstr("kdim=8, expected [batch=2, key_len, kdim=16]"));
}

TEST(ValidatorTest, RejectsBatchMismatch) {
  Call c = CrossCall({2, 5, 16}, {3, 7, 16}, {3, 7, 16});
  EXPECT_THAT(Check(c).message(),
              HasSubstr("key: shape [3, 7, 16] has batch=3, expected [batch=2"));
}

TEST(ValidatorTest, RejectsKeyValueLengthMismatch) {
  Call c = CrossCall({2, 5, 16}, {2, 7, 16}, {2, 6, 16});
  EXPECT_THAT(
      Check(c).message(),
      HasSubstr("value: shape [2, 6, 16] has key_len=6, expected [batch=2, key_len=7, vdim=16]"));
}

TEST(ValidatorTest, RejectsKeyWithoutValue) {
  Call c = SelfCall({2, 5, 16});
  c.call.key = c.Add(Zeros({2, 5, 16}));
  EXPECT_THAT(Check(c).message(), HasSubstr("value: missing"));
}

TEST(ValidatorTest, RejectsSelfAttentionWhenKdimDiffers) {
  Call c = SelfCall({2, 5, 16});
  EXPECT_THAT(Check(c, Model(16, 4, 8, 16)).message(),
              HasSubstr("key: missing; model 'm' has kdim=8"));
}

TEST(ValidatorTest, RejectsByteCountMismatch) {
  Call c = SelfCall({2, 5, 16});
  c.call.query.nbytes -= 4;
  EXPECT_THAT(Check(c).message(),
              HasSubstr("query: data has 636 bytes, expected 640 for shape [2, 5, 16] of float32"));
}

TEST(ValidatorTest, RejectsZeroAndNegativeDims) {
  for (int64_t bad : {0, -3}) {
    Call c = SelfCall({2, 5, 16});
    c.call.query.shape = {2, bad, 16};
    EXPECT_THAT(Check(c).message(), HasSubstr("has a dimension < 1")) << bad;
  }
}

TEST(ValidatorTest, RejectsBoolQuery) {
  Call c;
  c.call.query = c.Add(Zeros({2, 5, 16}, DType::kBool));
  EXPECT_THAT(Check(c).message(), HasSubstr("query: dtype bool is not allowed"));
}

TEST(ValidatorTest, RejectsMixedDtypes) {
  Call c = SelfCall({2, 5, 16});
  c.call.key = c.Add(Zeros({2, 5, 16}, DType::kFloat16));
  c.call.value = c.Add(Zeros({2, 5, 16}, DType::kFloat16));
  EXPECT_THAT(Check(c).message(), HasSubstr("key: dtype float16 differs from the query's float32"));
}

TEST(ValidatorTest, RejectsKeyPaddingMaskOfWrongShape) {
  Call c = SelfCall({2, 5, 16});
  c.call.key_padding_mask = c.Add(Zeros({2, 4}, DType::kBool));
  EXPECT_THAT(
      Check(c).message(),
      HasSubstr("key_padding_mask: shape [2, 4] has key_len=4, expected [batch=2, key_len=5]"));
}

TEST(ValidatorTest, AcceptsBoolAndFloatMasks) {
  Call c = SelfCall({2, 5, 16});
  c.call.key_padding_mask = c.Add(Zeros({2, 5}, DType::kBool));
  c.call.attn_mask = c.Add(Zeros({8, 5, 5}, DType::kFloat32));
  EXPECT_TRUE(Check(c).ok()) << Check(c).message();
}

TEST(ValidatorTest, RejectsAttnMaskOfWrongShape) {
  Call c = SelfCall({2, 5, 16});
  c.call.attn_mask = c.Add(Zeros({4, 5, 5}, DType::kBool));
  EXPECT_THAT(Check(c).message(),
              HasSubstr("attn_mask: shape [4, 5, 5] has batch*num_heads=4, expected "
                        "[batch*num_heads=8, query_len=5, key_len=5] or [query_len=5, key_len=5]"));
}

TEST(ValidatorTest, RejectsAttnMaskOfWrongRank) {
  Call c = SelfCall({2, 5, 16});
  c.call.attn_mask = c.Add(Zeros({5}, DType::kBool));
  EXPECT_THAT(Check(c).message(), HasSubstr("attn_mask: shape [5] has 1 dims"));
}

TEST(ValidatorTest, RejectsRequestOverTokenLimit) {
  Call c = SelfCall({4, 100, 16});
  AttendLimits limits;
  limits.max_tokens = 399;
  EXPECT_THAT(Check(c, Model(), limits).message(),
              HasSubstr("400 tokens (batch * query_len, plus batch * key_len for cross-attention) "
                        "is over the per-request limit of 399"));
}

// Counts made of request sizes are checked arithmetic: a session that (says it) holds nearly 2^63
// tokens makes key_len and the score count overflow int64; both are refused as over the limit,
// never wrapped into a small or negative number (UBSan in tools/sanitize.sh would also report it).
TEST(ValidatorTest, SizesThatOverflowInt64AreRefusedNotWrapped) {
  for (int64_t held :
       {std::numeric_limits<int64_t>::max() - 2, std::numeric_limits<int64_t>::max() / 4}) {
    Call c = SelfCall({1, 4, 16});
    c.call.kv_use = AttendCall::Kv::kSession;
    c.call.kv_batch = 1;
    c.call.kv_length = held;
    AttendLimits limits;
    limits.max_tokens = std::numeric_limits<int64_t>::max();
    limits.max_attention_scores = std::numeric_limits<int64_t>::max() - 1;
    const Status st = Check(c, Model(), limits);
    ASSERT_FALSE(st.ok()) << held;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("more than 2^63 attention scores")) << st.message();
  }
}

TEST(ValidatorTest, RejectsRequestOverAttentionScoreLimit) {
  Call c = SelfCall({1, 100, 16});
  AttendLimits limits;
  limits.max_attention_scores = 100 * 100 * 4 - 1;
  EXPECT_THAT(Check(c, Model(), limits).message(), HasSubstr("attention scores"));
}

}  // namespace
}  // namespace attnserve
