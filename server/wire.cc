#include "server/wire.h"

#include <google/protobuf/stubs/logging.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <atomic>
#include <chrono>
#include <cstdio>

namespace attnserve {
namespace {

namespace gp = google::protobuf;

// Protobuf logs an ERROR line for every message it fails to parse (e.g. a string field that is not
// UTF-8). Those are a client's bad input, which the client is told about in its status: writing
// them per request would let any client fill the log and, once a log pipe is slow or unread,
// block the server's gRPC threads in write(2) (the soak stalled so). While a thread parses a
// request, protobuf's message is captured for the status instead; anything else protobuf logs
// goes to stderr, at most one line a second.
thread_local std::string* t_parse_log = nullptr;
std::atomic<int64_t> g_last_log_second{0};

void ProtobufLog(gp::LogLevel level, const char* file, int line, const std::string& message) {
  if (t_parse_log != nullptr && level != gp::LOGLEVEL_FATAL) {
    if (t_parse_log->empty()) *t_parse_log = message;
    return;
  }
  const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count();
  int64_t last = g_last_log_second.load();
  if (level != gp::LOGLEVEL_FATAL &&
      (now == last || !g_last_log_second.compare_exchange_strong(last, now))) {
    return;
  }
  std::fprintf(stderr, "attnserve: protobuf %s:%d: %s\n", file, line, message.c_str());
}

// Sets t_parse_log for one parse; installs the handler on first use.
class CaptureProtobufLog {
 public:
  explicit CaptureProtobufLog(std::string* into) {
    static const bool installed = (gp::SetLogHandler(&ProtobufLog), true);
    (void)installed;
    t_parse_log = into;
  }
  ~CaptureProtobufLog() { t_parse_log = nullptr; }
  CaptureProtobufLog(const CaptureProtobufLog&) = delete;
  CaptureProtobufLog& operator=(const CaptureProtobufLog&) = delete;
};

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

Status LayoutFromWire(int layout, AttendCall* call) {
  switch (layout) {
    case pb::LAYOUT_UNSPECIFIED:
    case pb::LAYOUT_BATCH_FIRST: call->layout = TensorLayout::kBatchFirst; return Status::Ok();
    case pb::LAYOUT_SEQUENCE_FIRST: call->layout = TensorLayout::kSequenceFirst; return Status::Ok();
    default:
      return InvalidArgument("layout: " + std::to_string(layout) +
                             " is not allowed; expected BATCH_FIRST (1) or SEQUENCE_FIRST (2)");
  }
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
  RETURN_IF_ERROR(LayoutFromWire(r.layout(), call));
  if (!r.session().empty()) call->is_causal = true;  // A session's steps are causal.
  return Status::Ok();
}

Status FromWire(const pb::CreateMemoryRequest& r, AttendCall* call) {
  RETURN_IF_ERROR(OptionalView("key", r.has_key(), r.key(), &call->key));
  RETURN_IF_ERROR(OptionalView("value", r.has_value(), r.value(), &call->value));
  RETURN_IF_ERROR(OptionalView("key_padding_mask", r.has_key_padding_mask(), r.key_padding_mask(),
                               &call->key_padding_mask));
  return LayoutFromWire(r.layout(), call);
}

Status ParseRequest(const grpc::ByteBuffer& bytes, pb::AttendRequest* request) {
  grpc::ByteBuffer copy(bytes);  // Shares the slices; the reader needs a mutable buffer.
  grpc::ProtoBufferReader reader(&copy);
  std::string why;
  bool parsed;
  {
    CaptureProtobufLog capture(&why);
    parsed = request->ParseFromZeroCopyStream(&reader);
  }
  if (!parsed) {
    // Protobuf says why only for some failures (a string field that is not UTF-8 names the field).
    while (!why.empty() && why.back() == ' ') why.pop_back();
    return InvalidArgument("request: " + std::to_string(bytes.Length()) +
                           " bytes do not decode as an attnserve.v1.AttendRequest: " +
                           (why.empty() ? "malformed protobuf" : "protobuf: " + why));
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
  info->set_version(s.version);
}

}  // namespace attnserve
