#include "server/wire.h"

#include <grpcpp/support/proto_buffer_reader.h>

namespace attnserve {
namespace {

// Appends a protobuf varint.
void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// `field` (a Tensor in AttendResponse) again, holding only data = `bytes` (which follow the
// returned prefix): tag, length of the Tensor, then Tensor.data's tag and length.
std::string TensorDataPrefix(int field, size_t bytes) {
  std::string p;
  const uint64_t inner = 1 + VarintSize(bytes) + bytes;  // Tensor.data: tag 3, length, bytes.
  PutVarint(static_cast<uint64_t>(field) << 3 | 2, &p);
  PutVarint(inner, &p);
  PutVarint(3 << 3 | 2, &p);
  PutVarint(bytes, &p);
  return p;
}

void DeleteString(void* s) { delete static_cast<std::string*>(s); }

// A slice over `s`'s bytes that owns `s`.
grpc::Slice OwningSlice(std::unique_ptr<std::string> s) {
  std::string* raw = s.release();
  return grpc::Slice(raw->data(), raw->size(), DeleteString, raw);
}

Status ViewOf(const char* field, const pb::Tensor& t, TensorView* view) {
  switch (t.dtype()) {
    case pb::DATA_TYPE_FLOAT32: view->dtype = DType::kFloat32; break;
    case pb::DATA_TYPE_FLOAT16: view->dtype = DType::kFloat16; break;
    case pb::DATA_TYPE_BFLOAT16: view->dtype = DType::kBFloat16; break;
    case pb::DATA_TYPE_BOOL: view->dtype = DType::kBool; break;
    default:
      return InvalidArgument(std::string(field) + ": dtype " + std::to_string(t.dtype()) +
                             " is not allowed; expected FLOAT32, FLOAT16, BFLOAT16 or BOOL");
  }
  view->shape.assign(t.shape().begin(), t.shape().end());
  if (view->shape.empty()) {
    return InvalidArgument(std::string(field) + ": shape is empty; expected at least one dimension");
  }
  view->data = t.data().data();
  view->nbytes = t.data().size();
  return Status::Ok();
}

Status OptionalView(const char* field, bool present, const pb::Tensor& t,
                    std::optional<TensorView>* view) {
  if (!present) return Status::Ok();
  view->emplace();
  return ViewOf(field, t, &**view);
}

}  // namespace

Status FromWire(const pb::AttendRequest& r, AttendCall* call) {
  if (!r.has_query()) return InvalidArgument("query: missing; expected a tensor");
  RETURN_IF_ERROR(ViewOf("query", r.query(), &call->query));
  RETURN_IF_ERROR(OptionalView("key", r.has_key(), r.key(), &call->key));
  RETURN_IF_ERROR(OptionalView("value", r.has_value(), r.value(), &call->value));
  RETURN_IF_ERROR(OptionalView("key_padding_mask", r.has_key_padding_mask(), r.key_padding_mask(),
                               &call->key_padding_mask));
  RETURN_IF_ERROR(OptionalView("attn_mask", r.has_attn_mask(), r.attn_mask(), &call->attn_mask));
  call->is_causal = r.is_causal();
  switch (r.attn_weights()) {
    case pb::ATTN_WEIGHTS_NONE: call->weights = WeightsMode::kNone; break;
    case pb::ATTN_WEIGHTS_AVERAGED: call->weights = WeightsMode::kAveraged; break;
    case pb::ATTN_WEIGHTS_PER_HEAD: call->weights = WeightsMode::kPerHead; break;
    default:
      return InvalidArgument("attn_weights: " + std::to_string(r.attn_weights()) +
                             " is not allowed; expected NONE (0), AVERAGED (1) or PER_HEAD (2)");
  }
  switch (r.layout()) {
    case pb::LAYOUT_UNSPECIFIED:
    case pb::LAYOUT_BATCH_FIRST: call->layout = TensorLayout::kBatchFirst; break;
    case pb::LAYOUT_SEQUENCE_FIRST: call->layout = TensorLayout::kSequenceFirst; break;
    default:
      return InvalidArgument("layout: " + std::to_string(r.layout()) +
                             " is not allowed; expected BATCH_FIRST (1) or SEQUENCE_FIRST (2)");
  }
  return Status::Ok();
}

Status ParseRequest(const grpc::ByteBuffer& bytes, pb::AttendRequest* request) {
  grpc::ByteBuffer copy(bytes);  // Shares the slices; the reader needs a mutable buffer.
  grpc::ProtoBufferReader reader(&copy);
  if (!request->ParseFromZeroCopyStream(&reader)) {
    return InvalidArgument("request: " + std::to_string(bytes.Length()) +
                           " bytes do not decode as an attnserve.v1.AttendRequest (malformed "
                           "protobuf, or a string field such as `model` that is not valid UTF-8)");
  }
  return Status::Ok();
}

grpc::ByteBuffer EncodeResponse(const pb::AttendResponse& meta, std::unique_ptr<std::string> output,
                                std::unique_ptr<std::string> weights) {
  std::vector<grpc::Slice> slices;
  std::string head = meta.SerializeAsString();
  if (output) {
    head += TensorDataPrefix(pb::AttendResponse::kOutputFieldNumber, output->size());
    slices.emplace_back(head);
    slices.push_back(OwningSlice(std::move(output)));
  } else {
    slices.emplace_back(head);
  }
  if (weights) {
    slices.emplace_back(TensorDataPrefix(pb::AttendResponse::kAttnWeightsFieldNumber, weights->size()));
    slices.push_back(OwningSlice(std::move(weights)));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

pb::DataType ToWire(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return pb::DATA_TYPE_FLOAT32;
    case DType::kFloat16: return pb::DATA_TYPE_FLOAT16;
    case DType::kBFloat16: return pb::DATA_TYPE_BFLOAT16;
    case DType::kBool: return pb::DATA_TYPE_BOOL;
  }
  return pb::DATA_TYPE_UNSPECIFIED;
}

void ToWire(const ModelSpec& s, pb::ModelInfo* info) {
  info->set_name(s.name);
  info->set_embed_dim(s.embed_dim);
  info->set_num_heads(s.num_heads);
  info->set_kdim(s.kdim);
  info->set_vdim(s.vdim);
  info->set_bias(s.bias);
  info->set_add_bias_kv(s.add_bias_kv);
  info->set_add_zero_attn(s.add_zero_attn);
  info->set_compute_dtype(ToWire(s.compute_dtype));
  info->set_device(s.device);
  info->set_weights_hash(s.weights_hash);
  info->set_source(s.source);
}

}  // namespace attnserve
