// The one status mapping: each internal code's name is the name of the gRPC code it maps to.
#include "server/grpc/grpc_status.h"

#include <absl/status/status.h>
#include <gtest/gtest.h>

namespace attnserve {
namespace {

TEST(StatusNames, AreTheNamesOfTheGrpcCodesTheyMapTo) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    const auto code = static_cast<StatusCode>(c);
    const auto grpc = static_cast<absl::StatusCode>(ToGrpcCode(code));
    EXPECT_EQ(StatusCodeName(code), absl::StatusCodeToString(grpc)) << c;
  }
}

}  // namespace
}  // namespace attnserve
