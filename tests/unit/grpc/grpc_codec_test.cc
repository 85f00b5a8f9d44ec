// Answers encoded without copying their tensors: from a string of their own or from a staging
// block, which the encoded message holds until gRPC lets go of it.
#include "server/grpc/grpc_codec.h"

#include <gtest/gtest.h>

#include <random>

namespace attnserve {
namespace {

v1::AttendResponse Meta() {
  v1::AttendResponse meta;
  meta.set_request_id(41);
  meta.mutable_output()->set_dtype(v1::DATA_TYPE_FLOAT32);
  meta.mutable_output()->add_shape(1);
  meta.mutable_output()->add_shape(2);
  return meta;
}

TEST(GrpcCodecTest, AnOutputInAStagingBlockIsSentFromItAndHeldUntilSent) {
  auto block = std::make_shared<std::string>("....12345678....");
  std::weak_ptr<std::string> alive = block;
  AnswerBytes out;
  out.block = {block, block->data() + 4, 8};
  block.reset();
  v1::AttendResponse decoded;
  {
    grpc::ByteBuffer buffer = EncodeResponse(Meta(), std::move(out), nullptr);
    EXPECT_FALSE(alive.expired());  // The message holds the block.
    ASSERT_TRUE(ParseMessage(buffer, &decoded).ok());
  }
  EXPECT_TRUE(alive.expired());  // Given back once the message is gone.
  EXPECT_EQ(decoded.request_id(), 41u);
  EXPECT_EQ(decoded.output().data(), "12345678");
  EXPECT_EQ(decoded.output().shape_size(), 2);
}

TEST(GrpcCodecTest, AnOutputOfItsOwnAndWeightsAreSentAsTheirFields) {
  AnswerBytes out;
  out.own = std::make_unique<std::string>("abcdefgh");
  v1::AttendResponse meta = Meta();
  meta.mutable_attn_weights()->set_dtype(v1::DATA_TYPE_FLOAT32);
  grpc::ByteBuffer buffer =
      EncodeResponse(meta, std::move(out), std::make_unique<std::string>("wxyz"));
  v1::AttendResponse decoded;
  ASSERT_TRUE(ParseMessage(buffer, &decoded).ok());
  EXPECT_EQ(decoded.output().data(), "abcdefgh");
  EXPECT_EQ(decoded.attn_weights().data(), "wxyz");
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// `bytes` as gRPC hands them over: in several slices, cut at `seed`'s places.
grpc::ByteBuffer Sliced(const std::string& bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size();) {
    const size_t n = std::min(bytes.size() - at, size_t{1} + rng() % 700);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

v1::Tensor RandomTensor(std::mt19937& rng, int64_t len, int64_t dim) {
  v1::Tensor t;
  t.set_dtype(rng() % 2 ? v1::DATA_TYPE_FLOAT32 : v1::DATA_TYPE_BFLOAT16);
  for (int64_t d : {int64_t{1}, len, dim}) t.add_shape(d);
  std::string data(static_cast<size_t>(len * dim) * (t.dtype() == v1::DATA_TYPE_FLOAT32 ? 4 : 2),
                   0);
  for (char& c : data) c = static_cast<char>(rng());
  t.set_data(std::move(data));
  return t;
}

// The staged message with its tensors' bytes put back where the plain parse has them.
std::string Restored(v1::AttendRequest request, const StagedInputs& staged) {
  const auto put = [](const BlockBytes& b, v1::Tensor* t) {
    if (b) t->set_data(std::string(b.data, b.size));
  };
  if (staged.query) put(staged.query, request.mutable_query());
  if (staged.key) put(staged.key, request.mutable_key());
  if (staged.value) put(staged.value, request.mutable_value());
  return request.SerializeAsString();
}

// Decoding into staging gives the message the plain parse gives, for random requests of every
// kind, whatever the slices; the tensors' bytes are in the staging (counted there) and not in the
// message.
TEST(GrpcCodecTest, StagedDecodeEqualsThePlainParse) {
  HostStaging staging(int64_t{1} << 26, /*pinned=*/false);
  for (uint32_t seed = 1; seed <= 200; ++seed) {
    std::mt19937 rng(seed);
    v1::AttendRequest r;
    r.set_model(seed % 3 ? "demo" : "another");
    r.set_request_id(seed);
    const int64_t lq = 1 + rng() % 40, lk = 1 + rng() % 40;
    *r.mutable_query() = RandomTensor(rng, lq, 16);
    const bool cross = rng() % 2;
    if (cross) {
      *r.mutable_key() = RandomTensor(rng, lk, 16);
      *r.mutable_value() = RandomTensor(rng, lk, 16);
    }
    if (rng() % 3 == 0) r.mutable_key_padding_mask()->set_data(std::string(lk, '\1'));
    r.set_is_causal(rng() % 2);
    r.set_layout(rng() % 2 ? v1::LAYOUT_SEQUENCE_FIRST : v1::LAYOUT_BATCH_FIRST);
    if (rng() % 4 == 0) r.set_session("s-" + std::to_string(seed));
    std::string wire = r.SerializeAsString();
    if (seed % 5 == 0) wire += std::string("\xf8\x07\x2a", 3);  // An unknown field (127 = 42).
    v1::AttendRequest plain, staged_request;
    ASSERT_TRUE(ParseRequest(Sliced(wire, seed), &plain).ok());
    StagedInputs staged;
    ASSERT_TRUE(ParseRequest(Sliced(wire, seed + 1000), &staged_request, &staging, &staged).ok());
    ASSERT_TRUE(staged.query) << seed;
    EXPECT_EQ(static_cast<bool>(staged.key), cross) << seed;
    EXPECT_TRUE(staged_request.query().data().empty());
    EXPECT_EQ(staged.bytes(), static_cast<int64_t>(r.query().data().size() + r.key().data().size() +
                                                   r.value().data().size()));
    EXPECT_GE(staging.held_bytes(), staged.bytes());
    EXPECT_EQ(Restored(staged_request, staged), plain.SerializeAsString()) << "seed " << seed;
  }
  EXPECT_EQ(staging.held_bytes(), 0);  // Every block given back with its StagedInputs.
}

// What the staged decode leaves to the plain parse, decoded exactly as it does, nothing staged:
// a tensor field or its data repeated (protobuf merges them), an unknown field inside a tensor,
// shapes unpacked, a staging without room, and malformed messages (the same error).
TEST(GrpcCodecTest, StagedDecodeLeavesTheUnusualToThePlainParse) {
  std::mt19937 rng(7);
  v1::AttendRequest base;
  base.set_model("demo");
  *base.mutable_query() = RandomTensor(rng, 5, 8);
  const std::string query = base.SerializeAsString();
  v1::Tensor extra;
  extra.add_shape(9);
  extra.set_data("zz");
  v1::AttendRequest again;
  *again.mutable_query() = extra;
  std::string tensor_with_unknown = base.query().SerializeAsString() + std::string("\x28\x01", 2);
  std::string unknown_inside = std::string("\x12", 1);  // query (field 2), length-delimited
  unknown_inside += static_cast<char>(tensor_with_unknown.size());
  unknown_inside += tensor_with_unknown;
  // Shape written unpacked (field 2 as varints): the staged decode reads it as the plain one.
  std::string unpacked = "\x12";
  std::string t =
      std::string("\x08\x01\x10\x01\x10\x02\x10\x08\x1a\x40", 10) + std::string(64, 'q');
  unpacked += static_cast<char>(t.size());
  unpacked += t;
  // A tag of 7 bytes (CodedInputStream keeps its low 32 bits; protobuf's parser refuses it), a
  // length of 6 bytes, and a query longer than the message (found by fuzz_request).
  const std::string long_tag = std::string("\xba\xba\xba\xba\xba\xb2\x45\x00", 8) + query;
  const std::string long_length = std::string("\x0a\x81\x80\x80\x80\x80\x00", 7) + query;
  std::string cut = query;
  cut[1] = static_cast<char>(cut[1] + 40);
  const std::vector<std::pair<std::string, bool>> cases = {
      {long_tag, false},
      {long_length, false},
      {cut, false},
      {query + again.SerializeAsString(), false},           // The query field twice: merged.
      {unknown_inside, false},                              // An unknown field in a Tensor.
      {unpacked, true},                                     // Unpacked shape: staged.
      {query.substr(0, query.size() - 3), false},           // Truncated.
      {std::string("\x0a\x02\xc3\x28", 4) + query, false},  // model not UTF-8.
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    HostStaging staging(1 << 20, false);
    v1::AttendRequest plain, staged_request;
    const Status p = ParseRequest(Sliced(cases[i].first, 3), &plain);
    StagedInputs staged;
    const Status s = ParseRequest(Sliced(cases[i].first, 4), &staged_request, &staging, &staged);
    EXPECT_EQ(p.code(), s.code()) << "case " << i;
    EXPECT_EQ(p.message(), s.message()) << "case " << i;
    EXPECT_EQ(static_cast<bool>(staged.query), cases[i].second) << "case " << i;
    if (p.ok()) EXPECT_EQ(Restored(staged_request, staged), plain.SerializeAsString()) << i;
    staged = StagedInputs();
    EXPECT_EQ(staging.held_bytes(), 0) << "case " << i;
  }
  HostStaging full(64, false);  // No room for the query's 160 bytes.
  v1::AttendRequest plain;
  StagedInputs staged;
  ASSERT_TRUE(ParseRequest(Sliced(query, 5), &plain, &full, &staged).ok());
  EXPECT_FALSE(staged.query);
  EXPECT_EQ(plain.SerializeAsString(), query);
  EXPECT_EQ(full.refused(), 1);
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A hostile review (2026-12-05): 16 MiB of empty repeated entries parsed into 1.8 GiB before any
// budget saw the request. The estimate refuses such a message before it is parsed, and passes real
// requests, whose size is their tensors' bytes.
TEST(GrpcCodecTest, AMessageThatWouldGrowPastItsBoundIsRefusedBeforeItIsParsed) {
  std::string empties;
  for (int i = 0; i < (1 << 20); ++i) empties += std::string("\x22\x00", 2);  // value, empty.
  v1::AttendRequest request;
  const Status refused = ParseMessage(BufferOf(std::string("\x12\x00", 2) + empties), &request);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  // A packed shape of a million one-byte dimensions: 8 MiB once parsed from 1 MiB.
  v1::Tensor shape;
  std::string dims(1 << 20, '\x01');
  std::string packed = std::string("\x12", 1);  // Tensor.shape, packed.
  for (uint32_t n = static_cast<uint32_t>(dims.size());; n >>= 7) {
    packed += static_cast<char>(n >= 0x80 ? (n & 0x7f) | 0x80 : n);
    if (n < 0x80) break;
  }
  EXPECT_EQ(ParseMessage(BufferOf(packed + dims), &shape).code(), StatusCode::kInvalidArgument);
  // A real request of 4 MiB of tensor bytes passes.
  std::mt19937 rng(1);
  v1::AttendRequest real;
  real.set_model("demo");
  v1::Tensor* q = real.mutable_query();
  q->set_dtype(v1::DATA_TYPE_FLOAT32);
  for (int64_t d : {1, 2048, 512}) q->add_shape(d);
  q->mutable_data()->resize(4 << 20, static_cast<char>(rng()));
  v1::AttendRequest parsed;
  EXPECT_TRUE(ParseMessage(BufferOf(real.SerializeAsString()), &parsed).ok());
  EXPECT_EQ(parsed.query().data().size(), size_t{4} << 20);
  // Small messages pass whatever their fields (the 1 MiB floor).
  EXPECT_TRUE(
      ParseMessage(BufferOf(std::string("\x12\x00", 2) + empties.substr(0, 2000)), &request).ok());
}

}  // namespace
}  // namespace attnserve
