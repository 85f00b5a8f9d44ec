// Answers encoded without copying their tensors: from a string of their own or from a staging
// block, which the encoded message holds until gRPC lets go of it.
#include "server/grpc/grpc_codec.h"

#include <gtest/gtest.h>

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
