#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <memory>
#include <string>

#include "attnserve/v1/attention.pb.h"
#include "server/status.h"
#include "server/types.h"

namespace attnserve {

namespace pb = ::attnserve::v1;

/// Builds the engine's view of `request` without copying tensor bytes: the views point into
/// `request`, which must outlive `call`. Rejects unknown enum values (INVALID_ARGUMENT).
Status FromWire(const pb::AttendRequest& request, AttendCall* call);
/// The same for CreateMemory's key, value, key_padding_mask and layout (no query).
Status FromWire(const pb::CreateMemoryRequest& request, AttendCall* call);

/// Decodes one AttendRequest message. INVALID_ARGUMENT saying why when the bytes are not one (for
/// example a `model` string that is not UTF-8, which protobuf refuses).
Status ParseRequest(const grpc::ByteBuffer& bytes, pb::AttendRequest* request);

/// Encodes `meta` (an AttendResponse whose tensors carry dtype and shape but no data) followed by the
/// output and attention-weights bytes, which become the message's slices without a copy: the buffers
/// are handed to gRPC and freed once sent. Protobuf merges a repeated occurrence of a message field
/// into the first, so receivers see the bytes as output.data and attn_weights.data.
grpc::ByteBuffer EncodeResponse(const pb::AttendResponse& meta, std::unique_ptr<std::string> output,
                                std::unique_ptr<std::string> weights);

/// Fixed bytes an encoded response adds to its tensor data (ids, names, hash, shapes, timing).
inline constexpr size_t kResponseOverheadBytes = 1024;

/// Wire dtype of a domain dtype.
pb::DataType ToWire(DType dtype);

/// Fills a ModelInfo.
void ToWire(const ModelSpec& spec, pb::ModelInfo* info);

}  // namespace attnserve
