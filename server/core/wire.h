#pragma once

#include <memory>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "server/core/status.h"
#include "server/core/types.h"

namespace attnserve {

namespace pb = ::attnserve::v1;

/// One answer tensor's bytes on their way out: a string of its own, or a staging block's bytes.
struct AnswerBytes {
  std::unique_ptr<std::string> own;
  BlockBytes block;
  size_t size() const { return block ? block.size : own ? own->size() : 0; }
};

/// An answer in parts: the response's fields with the tensors' dtype and shape but no data, and the
/// tensors' bytes, which the engine wrote in place. Each front end encodes it its own way
/// (attnserve.v1 over gRPC: grpc_codec.h's EncodeResponse, without copying the bytes).
struct AttendAnswer {
  pb::AttendResponse meta;
  std::unique_ptr<std::string> output;
  /// The output's bytes when the engine left them in a staging block (AttendOutputs::output_block);
  /// `output` is then empty.
  BlockBytes output_block;
  std::unique_ptr<std::string> weights;  ///< Null when no attention weights were asked for.
  /// A batched step's answers, one per entry in the request's order (meta.steps has their fields
  /// but no data and no error): each entry's status (a refused or failed one carries no output)
  /// and output bytes.
  std::vector<Status> step_status;
  std::vector<AnswerBytes> step_output;
};

/// An AttendRequest's query, key and value bytes that the front end decoded straight into pinned
/// staging blocks (a CUDA server: grpc_codec.h's ParseRequest) instead of the message, whose
/// Tensor.data then stays empty: each is one copy from the wire, and the device copies it from
/// there without staging it again. Empty for a tensor that was not staged.
struct StagedInputs {
  BlockBytes query, key, value;
  /// Bytes staged (they are not in the message's ByteSizeLong).
  int64_t bytes() const { return static_cast<int64_t>(query.size + key.size + value.size); }
};

/// Where an answer must fit when it goes to memory the caller gave (a shared-memory region): the
/// most bytes of the output and of the attention weights, and the field that named the place (for
/// the message). -1: anywhere (the answer travels in the message).
struct OutputLimits {
  struct Bound {
    int64_t bytes = -1;
    std::string field;
  };
  Bound output, weights;
  /// INVALID_ARGUMENT naming the field when a validated call's answer would not fit.
  Status Check(const AttendCall& call) const;
};

/// Points `call`'s query, key and value views (FromWire's) at their staged bytes, marked pinned.
void UseStaged(const StagedInputs& staged, AttendCall* call);

/// Builds the engine's view of `request` without copying tensor bytes: the views point into
/// `request`, which must outlive `call`. Rejects unknown enum values (INVALID_ARGUMENT).
Status FromWire(const pb::AttendRequest& request, AttendCall* call);
/// A batched step (AttendRequest.steps not empty): INVALID_ARGUMENT naming every field of the
/// request's own that only a single request carries (query, masks, session, positions...).
Status CheckBatchedStep(const pb::AttendRequest& request);
/// One entry of a batched step as the engine's call (a session step or a memory's query, layout
/// batch-first), its views into `step`; `field` ("steps[3]") begins its messages. The handle is
/// resolved elsewhere.
Status FromWire(const pb::Step& step, const std::string& field, AttendCall* call);
/// The same for CreateMemory's key, value, key_padding_mask and layout (no query).
Status FromWire(const pb::CreateMemoryRequest& request, AttendCall* call);

/// INVALID_ARGUMENT naming `field` unless `window_bytes` (a shared-memory window) is exactly what
/// `tensor`'s dtype and shape take; checked before a byte of the window is read.
Status CheckTensorWindow(const pb::Tensor& tensor, int64_t window_bytes, const std::string& field);

/// Wire dtype of a domain dtype.
pb::DataType ToWire(DType dtype);

/// Fills a ModelInfo.
void ToWire(const ModelSpec& spec, pb::ModelInfo* info);

}  // namespace attnserve
