#pragma once

#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "inference/grpc_service.pb.h"
#include "server/core/status.h"
#include "server/core/types.h"
#include "server/core/wire.h"
#include "server/protocol/oip_sequences.h"
#include "server/shm/shared_memory.h"

namespace attnserve {

/// The Open Inference Protocol's names for attnserve's tensors and parameters (docs/api.md "Open
/// Inference Protocol"). Inputs: query, key, value, key_padding_mask, attn_mask (the names of
/// AttendRequest's fields); outputs: attn_output and attn_weights (nn.MultiheadAttention's).
/// Request parameters: is_causal (bool), attn_weights ("none", "averaged", "per_head"), layout
/// ("batch_first", "sequence_first"); memory, session, session_length (kept keys and values by
/// handle); Triton's sequence_id, sequence_start, sequence_end (sessions by correlation id).
namespace oip {
inline constexpr const char* kOutput = "attn_output";
inline constexpr const char* kWeights = "attn_weights";
}  // namespace oip

/// What the answer must carry back that the attnserve.v1 request does not hold: the OIP request's
/// id and model version string, and the outputs asked for, in order.
/// A tensor's place in a shared-memory region (Triton's shared_memory_* parameters), checked
/// against the region when the request was decoded.
using OipRegion = RegionRef;

struct OipReply {
  std::string id;
  std::vector<std::string> outputs;  ///< oip::kOutput and/or oip::kWeights.
  /// By `outputs` index: the region the output goes to, or nothing (it goes in the message).
  std::vector<std::optional<OipRegion>> output_regions;
  /// The regions the request read its inputs from, held until it is answered.
  std::vector<std::shared_ptr<const SharedRegion>> regions;
  /// Triton's sequence parameters, when the request has them: the session is the sequence's.
  std::optional<OipSequence> sequence;
};

/// The batch a request's query carries (its B: [B, L, E] batch-first, [L, B, E] sequence-first, 1
/// unbatched): a sequence's session is opened for it.
int64_t OipBatchOf(const v1::AttendRequest& request);

/// Turns `in` into the AttendRequest the native API would have received for the same call, moving
/// each raw_input_contents entry into its tensor (no copy), reading an input in a shared-memory
/// region of `shm` into its tensor (one copy), and noting where outputs in a region go.
/// INVALID_ARGUMENT naming the field, what arrived and what is allowed, for what attnserve does not
/// take: unknown inputs, outputs or parameters, typed `contents` other than FP32 and BOOL, raw
/// contents that do not match the inputs not in shared memory, a version that is not a number, a
/// region window that does not fit its region or does not hold exactly its tensor's datatype and
/// shape; RESOURCE_EXHAUSTED when the inputs in regions take more than `max_region_bytes` in all
/// (FlowLimits::max_region_input_bytes; all checked before a byte is read); NOT_FOUND for a region
/// not registered;
/// FAILED_PRECONDITION when shared memory is off (`shm` null or not allowed).
Status OipToAttend(inference::ModelInferRequest* in, v1::AttendRequest* out, OipReply* reply,
                   const TenantRegions* shm = nullptr,
                   int64_t max_region_bytes = std::numeric_limits<int64_t>::max());

/// Where the answer must fit: the byte sizes of the output regions asked for.
OutputLimits OipOutputLimits(const OipReply& reply);

/// Writes the outputs that go to shared-memory regions there, and drops their bytes from `answer`
/// (their raw_output_contents entries are then empty). FAILED_PRECONDITION when a region was cut
/// short meanwhile.
Status OipWriteSharedOutputs(AttendAnswer* answer, const OipReply& reply);

/// The ModelInferResponse fields of a computed answer, without the tensors' bytes (they follow as
/// raw_output_contents, in `reply.outputs` order: Raw picks them from the answer).
inference::ModelInferResponse OipResponseHead(const AttendAnswer& answer, const OipReply& reply);
/// A ModelStreamInfer answer carrying an error: error_message is the status's message (as a unary
/// call's status would carry it), infer_response names the request (id, model, version) and
/// carries the status code's name ("INVALID_ARGUMENT") in its `error_code` parameter, and the
/// server's trace id of the request in `trace_id` when tracing is on.
inference::ModelStreamInferResponse OipStreamError(const v1::AttendRequest& request,
                                                   const OipReply& reply, const Status& status,
                                                   const std::string& trace_id = "");
/// The answer's buffers in `reply.outputs` order (handed over).
std::vector<AnswerBytes> OipRawOutputs(AttendAnswer* answer, const OipReply& reply);

/// An OIP version string as attnserve's: "" = 0 (the highest loaded), else a positive number.
StatusOr<int64_t> OipVersion(const std::string& version);

/// "FP32", "FP16", "BF16", "BOOL".
const char* OipDatatype(DType dtype);

/// A model version's metadata: its inputs and outputs with their datatypes and shapes (-1: any).
inference::ModelMetadataResponse OipModelMetadata(const ModelSpec& spec,
                                                  const std::vector<int64_t>& versions);

}  // namespace attnserve
