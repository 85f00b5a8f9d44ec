#pragma once

#include <google/protobuf/message.h>
#include <grpcpp/support/byte_buffer.h>

#include <memory>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "server/core/status.h"
#include "server/core/wire.h"
#include "server/engine/host_staging.h"

namespace attnserve {

/// Decodes one message of `message`'s type. INVALID_ARGUMENT saying why when the bytes are not one.
Status ParseMessage(const grpc::ByteBuffer& bytes, google::protobuf::Message* message);
/// What a message parsed as `descriptor`'s type may hold in memory, estimated from its wire format
/// before it is parsed: INVALID_ARGUMENT past kDecodedGrowth times its size (or kDecodedFloor),
/// where many tiny fields would multiply it (ParseMessage and ParseRequest check it first).
inline constexpr int64_t kDecodedGrowth = 4;
inline constexpr int64_t kDecodedFloor = int64_t{1} << 20;
Status WithinDecodedSize(const grpc::ByteBuffer& bytes,
                         const google::protobuf::Descriptor& descriptor);

/// Encodes `head` followed by each of `raw` as one more occurrence of the repeated bytes field
/// `field` (top level), each buffer handed to gRPC as a slice of its own without a copy. With an
/// `outer` field number, that message is itself the value of field `outer` of the message encoded
/// (ModelStreamInferResponse's infer_response), the rest of which is `outer_head`.
grpc::ByteBuffer EncodeWithRawBytes(const google::protobuf::Message& head, int field,
                                    std::vector<AnswerBytes> raw, int outer = 0,
                                    const google::protobuf::Message* outer_head = nullptr);

/// Decodes one AttendRequest message. INVALID_ARGUMENT saying why when the bytes are not one (for
/// example a `model` string that is not UTF-8, which protobuf refuses). With a `staging` (a CUDA
/// server's), the query's, key's and value's data go from the wire straight into pinned staging
/// blocks (`*staged`; their Tensor.data stays empty), one copy, which the device then copies from.
/// The message decodes exactly as without: anything unusual in those three fields (a field or its
/// data repeated, an unknown field inside a Tensor, a malformed message) and a staging without
/// room take the plain path, where nothing is staged.
Status ParseRequest(const grpc::ByteBuffer& bytes, v1::AttendRequest* request,
                    HostStaging* staging = nullptr, StagedInputs* staged = nullptr);

/// Encodes `meta` (an AttendResponse whose tensors carry dtype and shape but no data) followed by
/// the output and attention-weights bytes, which become the message's slices without a copy: the
/// buffers are handed to gRPC and freed once sent. Protobuf merges a repeated occurrence of a
/// message field into the first, so receivers see the bytes as output.data and attn_weights.data.
/// The output may lie in a staging block instead (AnswerBytes::block), which the slice holds.
grpc::ByteBuffer EncodeResponse(const v1::AttendResponse& meta, AnswerBytes output,
                                std::unique_ptr<std::string> weights);

/// Fixed bytes an encoded response adds to its tensor data (ids, names, hash, shapes, timing).
inline constexpr size_t kResponseOverheadBytes = 1024;

/// EncodeResponse of an answer's parts (its buffers are handed over); a batched step's answer
/// (meta.steps) as EncodeSteps.
grpc::ByteBuffer EncodeAnswer(AttendAnswer* answer);
/// A batched step's answer: `meta` with one StepResult per entry, each entry's output bytes a
/// slice of their own (no copy), a failed entry's status as its Error (the one status mapping).
grpc::ByteBuffer EncodeSteps(AttendAnswer* answer);

}  // namespace attnserve
