#include "server/grpc/grpc_codec.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <limits>

#include "server/grpc/grpc_status.h"

namespace attnserve {
namespace {

namespace gp = google::protobuf;
namespace pb = ::attnserve::v1;

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
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
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

// `field` (a Tensor in AttendResponse) again, holding only data = `bytes` (which follow the
// returned prefix): tag, length of the Tensor, then Tensor.data's tag and length.
std::string LengthPrefix(int field, size_t length) {
  using gp::internal::WireFormatLite;
  std::string p;
  {
    gp::io::StringOutputStream stream(&p);
    gp::io::CodedOutputStream out(&stream);
    out.WriteTag(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
    out.WriteVarint64(length);
  }
  return p;
}

std::string TensorDataPrefix(int field, size_t bytes) {
  const std::string data = LengthPrefix(pb::Tensor::kDataFieldNumber, bytes);
  return LengthPrefix(field, data.size() + bytes) + data;
}

void DeleteString(void* s) { delete static_cast<std::string*>(s); }

// A slice over `s`'s bytes that owns `s`.
grpc::Slice OwningSlice(std::unique_ptr<std::string> s) {
  std::string* raw = s.release();
  return grpc::Slice(raw->data(), raw->size(), DeleteString, raw);
}

void DeleteOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

// A slice over an answer's bytes that holds them: its string, or its staging block (given back
// once gRPC has sent them).
grpc::Slice AnswerSlice(AnswerBytes bytes) {
  if (!bytes.block)
    return OwningSlice(bytes.own ? std::move(bytes.own) : std::make_unique<std::string>());
  auto* owner = new std::shared_ptr<const void>(std::move(bytes.block.owner));
  return grpc::Slice(const_cast<char*>(bytes.block.data), bytes.block.size, DeleteOwner, owner);
}

}  // namespace

namespace {

using gp::internal::WireFormatLite;

// What parsing a message costs in memory beyond its wire bytes, estimated from the wire format and
// the message's descriptor before it is parsed: each message object kMessageCost, each scalar
// element 8 bytes, each string its bytes and kStringCost. Parsed, an empty repeated message entry
// (2 bytes on the wire) or a one-byte varint of a packed int64 takes 32-100x its wire size, and no
// budget sees a request before it is parsed (a hostile review, 2026-12-05: 16 MiB of empty OIP
// `inputs` held 1.8 GiB).
constexpr int64_t kMessageCost = 96, kStringCost = 32, kScalarCost = 8;
constexpr int kMaxDepth = 32;

// Walks the fields of the message `in` is limited to, adding to `*cost`; false once it passes
// `limit`. Anything malformed ends the walk quietly: the parse judges it.
bool WithinCost(gp::io::CodedInputStream* in, const gp::Descriptor* d, int depth, int64_t* cost,
                int64_t limit) {
  for (uint32_t tag; (tag = in->ReadTag()) != 0;) {
    const gp::FieldDescriptor* f =
        d != nullptr ? d->FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag)) : nullptr;
    uint64_t skip = 0;
    int length = 0;
    switch (WireFormatLite::GetTagWireType(tag)) {
      case WireFormatLite::WIRETYPE_VARINT:
        if (!in->ReadVarint64(&skip)) return true;
        *cost += kScalarCost;
        break;
      case WireFormatLite::WIRETYPE_FIXED64:
      case WireFormatLite::WIRETYPE_FIXED32:
        if (!in->Skip(WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_FIXED64 ? 8
                                                                                              : 4))
          return true;
        *cost += kScalarCost;
        break;
      case WireFormatLite::WIRETYPE_LENGTH_DELIMITED: {
        if (!in->ReadVarintSizeAsInt(&length) || length > in->BytesUntilLimit()) return true;
        const auto limit_at = in->PushLimit(length);
        if (f != nullptr && f->type() == gp::FieldDescriptor::TYPE_MESSAGE && depth < kMaxDepth) {
          *cost += kMessageCost;
          if (!WithinCost(in, f->message_type(), depth + 1, cost, limit)) return false;
        } else if (f != nullptr && f->is_packable()) {  // Packed scalars: one element a varint.
          const auto t = f->type();
          const int fixed =
              t == gp::FieldDescriptor::TYPE_FLOAT || t == gp::FieldDescriptor::TYPE_FIXED32 ||
                      t == gp::FieldDescriptor::TYPE_SFIXED32
                  ? 4
              : t == gp::FieldDescriptor::TYPE_DOUBLE || t == gp::FieldDescriptor::TYPE_FIXED64 ||
                      t == gp::FieldDescriptor::TYPE_SFIXED64
                  ? 8
                  : 0;
          if (fixed > 0) {
            *cost += length / fixed * kScalarCost;
          } else {
            while (in->BytesUntilLimit() > 0 && in->ReadVarint64(&skip)) *cost += kScalarCost;
          }
        } else {
          *cost += length + kStringCost;
        }
        in->Skip(in->BytesUntilLimit());
        in->PopLimit(limit_at);
        break;
      }
      default:
        return true;  // Groups, or malformed.
    }
    if (*cost > limit) return false;
  }
  return true;
}

}  // namespace

Status WithinDecodedSize(const grpc::ByteBuffer& bytes, const gp::Descriptor& descriptor) {
  const int64_t wire = static_cast<int64_t>(bytes.Length());
  const int64_t limit = std::max(kDecodedGrowth * wire, kDecodedFloor);
  grpc::ByteBuffer copy(bytes);
  grpc::ProtoBufferReader reader(&copy);
  gp::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(std::numeric_limits<int>::max());
  in.PushLimit(static_cast<int>(std::min<int64_t>(wire, std::numeric_limits<int>::max())));
  int64_t cost = 0;
  if (WithinCost(&in, &descriptor, 0, &cost, limit)) return Status::Ok();
  return InvalidArgument("request: " + std::to_string(wire) + " bytes of " + descriptor.name() +
                         " would hold over " + std::to_string(limit) +
                         " bytes once parsed (fields too many and too small: empty entries, "
                         "one-byte numbers); at most " +
                         std::to_string(kDecodedGrowth) + " times the message's size, or 1 MiB");
}

Status ParseMessage(const grpc::ByteBuffer& bytes, gp::Message* message) {
  RETURN_IF_ERROR(WithinDecodedSize(bytes, *message->GetDescriptor()));
  grpc::ByteBuffer copy(bytes);  // Shares the slices; the reader needs a mutable buffer.
  grpc::ProtoBufferReader reader(&copy);
  std::string why;
  bool parsed;
  {
    CaptureProtobufLog capture(&why);
    parsed = message->ParseFromZeroCopyStream(&reader);
  }
  if (!parsed) {
    // Protobuf says why only for some failures (a string field that is not UTF-8 names the field).
    while (!why.empty() && why.back() == ' ') why.pop_back();
    return InvalidArgument("request: " + std::to_string(bytes.Length()) +
                           " bytes do not decode as an " + message->GetTypeName() + ": " +
                           (why.empty() ? "malformed protobuf" : "protobuf: " + why));
  }
  return Status::Ok();
}

namespace {

// Reads the way protobuf's own parser does where CodedInputStream is more lenient: a tag or a
// length takes at most 5 bytes (CodedInputStream keeps the low 32 bits of a longer one, which the
// parser refuses), and field number 0 is no field. False: the plain parse judges the message.
// A tag of 0 is the end of the message (the limit, or the stream's end; a tag that reads as 0
// otherwise is malformed: ConsumedEntireMessage says which).
bool ReadTag(gp::io::CodedInputStream* in, uint32_t* tag) {
  const int at = in->CurrentPosition();
  *tag = in->ReadTag();
  return *tag == 0 ||
         (in->CurrentPosition() - at <= 5 && WireFormatLite::GetTagFieldNumber(*tag) != 0);
}
bool ReadLength(gp::io::CodedInputStream* in, int* length) {
  const int at = in->CurrentPosition();
  return in->ReadVarintSizeAsInt(length) && in->CurrentPosition() - at <= 5;
}

// One field that is not a staged tensor, copied to `out` as it came (its value re-encoded the
// same: protobuf merges the copy as it would the original). Groups are left to the plain parse.
bool CopyField(gp::io::CodedInputStream* in, uint32_t tag, gp::io::CodedOutputStream* out) {
  uint64_t v64 = 0;
  uint32_t v32 = 0;
  int length = 0;
  std::string bytes;
  switch (WireFormatLite::GetTagWireType(tag)) {
    case WireFormatLite::WIRETYPE_VARINT:
      if (!in->ReadVarint64(&v64)) return false;
      out->WriteTag(tag);
      out->WriteVarint64(v64);
      return true;
    case WireFormatLite::WIRETYPE_FIXED64:
      if (!in->ReadLittleEndian64(&v64)) return false;
      out->WriteTag(tag);
      out->WriteLittleEndian64(v64);
      return true;
    case WireFormatLite::WIRETYPE_FIXED32:
      if (!in->ReadLittleEndian32(&v32)) return false;
      out->WriteTag(tag);
      out->WriteLittleEndian32(v32);
      return true;
    case WireFormatLite::WIRETYPE_LENGTH_DELIMITED:
      if (!ReadLength(in, &length) || !in->ReadString(&bytes, length)) return false;
      out->WriteTag(tag);
      out->WriteVarint32(static_cast<uint32_t>(length));
      out->WriteString(bytes);
      return true;
    default:
      return false;
  }
}

// One Tensor's fields from `in` (limited to it) into `t`, its data into a staging block. False on
// anything the plain parse should judge.
bool ReadStagedTensor(gp::io::CodedInputStream* in, pb::Tensor* t, HostStaging& staging,
                      BlockBytes* data) {
  while (in->BytesUntilLimit() > 0) {
    uint32_t tag = 0;
    if (!ReadTag(in, &tag) || tag == 0) return false;
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto type = WireFormatLite::GetTagWireType(tag);
    uint64_t v = 0;
    int length = 0;
    if (field == pb::Tensor::kDtypeFieldNumber && type == WireFormatLite::WIRETYPE_VARINT) {
      if (!in->ReadVarint64(&v)) return false;
      t->set_dtype(static_cast<pb::DataType>(static_cast<int32_t>(v)));
    } else if (field == pb::Tensor::kShapeFieldNumber && type == WireFormatLite::WIRETYPE_VARINT) {
      if (!in->ReadVarint64(&v)) return false;
      t->add_shape(static_cast<int64_t>(v));
    } else if (field == pb::Tensor::kShapeFieldNumber &&
               type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!ReadLength(in, &length) || length > in->BytesUntilLimit()) return false;
      const auto limit = in->PushLimit(length);
      while (in->BytesUntilLimit() > 0) {
        if (!in->ReadVarint64(&v)) return false;
        t->add_shape(static_cast<int64_t>(v));
      }
      in->PopLimit(limit);
    } else if (field == pb::Tensor::kDataFieldNumber &&
               type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED && !*data) {
      if (!ReadLength(in, &length) || length > in->BytesUntilLimit()) return false;
      char* block = nullptr;
      std::shared_ptr<void> owner = staging.Allocate(static_cast<size_t>(length), &block);
      if (!owner || !in->ReadRaw(block, length)) return false;
      *data = {std::move(owner), block, static_cast<size_t>(length)};
    } else {
      return false;  // A repeated data, an unknown field: the plain parse decides.
    }
  }
  return true;
}

// The staged decode (ParseRequest): the three tensors read here, every other field copied as it
// came and merged by protobuf. False: decode it the plain way.
bool ParseStaged(const grpc::ByteBuffer& bytes, pb::AttendRequest* request, HostStaging& staging,
                 StagedInputs* staged) {
  grpc::ByteBuffer copy(bytes);
  grpc::ProtoBufferReader reader(&copy);
  gp::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(std::numeric_limits<int>::max());
  const int64_t total = static_cast<int64_t>(bytes.Length());
  std::string rest;
  gp::io::StringOutputStream rest_stream(&rest);
  gp::io::CodedOutputStream rest_out(&rest_stream);
  for (;;) {
    uint32_t tag = 0;
    if (!ReadTag(&in, &tag)) return false;
    if (tag == 0) {
      if (!in.ConsumedEntireMessage()) return false;
      break;
    }
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    BlockBytes* data = field == pb::AttendRequest::kQueryFieldNumber   ? &staged->query
                       : field == pb::AttendRequest::kKeyFieldNumber   ? &staged->key
                       : field == pb::AttendRequest::kValueFieldNumber ? &staged->value
                                                                       : nullptr;
    if (data == nullptr) {
      if (!CopyField(&in, tag, &rest_out)) return false;
      continue;
    }
    pb::Tensor* t = field == pb::AttendRequest::kQueryFieldNumber ? request->mutable_query()
                    : field == pb::AttendRequest::kKeyFieldNumber ? request->mutable_key()
                                                                  : request->mutable_value();
    int length = 0;
    if (*data || WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED ||
        !ReadLength(&in, &length) || length > total - in.CurrentPosition()) {
      return false;  // The field again, or cut short: the plain parse decides.
    }
    const auto limit = in.PushLimit(length);
    if (!ReadStagedTensor(&in, t, staging, data) || !*data) return false;
    in.PopLimit(limit);
  }
  rest_out.Trim();
  std::string why;
  CaptureProtobufLog capture(&why);
  return request->MergeFromString(rest);
}

}  // namespace

Status ParseRequest(const grpc::ByteBuffer& bytes, pb::AttendRequest* request, HostStaging* staging,
                    StagedInputs* staged) {
  if (staging != nullptr && staged != nullptr) {
    RETURN_IF_ERROR(WithinDecodedSize(bytes, *request->GetDescriptor()));
    if (ParseStaged(bytes, request, *staging, staged)) return Status::Ok();
    *staged = StagedInputs();
    request->Clear();
  }
  return ParseMessage(bytes, request);
}

grpc::ByteBuffer EncodeWithRawBytes(const gp::Message& head, int field,
                                    std::vector<AnswerBytes> raw, int outer,
                                    const gp::Message* outer_head) {
  std::vector<grpc::Slice> slices;
  slices.emplace_back();  // The outer message's head and prefix, once the inner length is known.
  std::string inner = head.SerializeAsString();
  size_t inner_length = inner.size();
  slices.emplace_back(std::move(inner));
  for (AnswerBytes& bytes : raw) {
    std::string prefix = LengthPrefix(field, bytes.size());
    inner_length += prefix.size() + bytes.size();
    slices.emplace_back(std::move(prefix));
    slices.push_back(AnswerSlice(std::move(bytes)));
  }
  if (outer == 0) return grpc::ByteBuffer(slices.data() + 1, slices.size() - 1);
  slices[0] = grpc::Slice((outer_head ? outer_head->SerializeAsString() : std::string()) +
                          LengthPrefix(outer, inner_length));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeResponse(const pb::AttendResponse& meta, AnswerBytes output,
                                std::unique_ptr<std::string> weights) {
  std::vector<grpc::Slice> slices;
  std::string head = meta.SerializeAsString();
  if (output.own || output.block) {
    head += TensorDataPrefix(pb::AttendResponse::kOutputFieldNumber, output.size());
    slices.emplace_back(head);
    slices.push_back(AnswerSlice(std::move(output)));
  } else {
    slices.emplace_back(head);
  }
  if (weights) {
    slices.emplace_back(
        TensorDataPrefix(pb::AttendResponse::kAttnWeightsFieldNumber, weights->size()));
    slices.push_back(OwningSlice(std::move(weights)));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeSteps(AttendAnswer* answer) {
  pb::AttendResponse& meta = answer->meta;
  google::protobuf::RepeatedPtrField<pb::StepResult> results;
  results.Swap(meta.mutable_steps());
  // Each entry: the steps field's tag and length, its fields but the output's data, then the data
  // as one more occurrence of its output (protobuf merges it into the first), its own slice.
  std::string head = meta.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (int i = 0; i < results.size(); ++i) {
    pb::StepResult& r = *results.Mutable(i);
    const size_t at = static_cast<size_t>(i);
    const Status& st = at < answer->step_status.size() ? answer->step_status[at] : Status::Ok();
    AnswerBytes bytes;
    if (!st.ok()) {
      r.clear_output();
      r.mutable_error()->set_code(static_cast<int>(ToGrpcCode(st.code())));
      r.mutable_error()->set_message(st.message());
    } else if (at < answer->step_output.size()) {
      bytes = std::move(answer->step_output[at]);
    }
    std::string body = r.SerializeAsString();
    const bool data = r.has_output() && (bytes.own || bytes.block);
    if (data) body += TensorDataPrefix(pb::StepResult::kOutputFieldNumber, bytes.size());
    head += LengthPrefix(pb::AttendResponse::kStepsFieldNumber,
                         body.size() + (data ? bytes.size() : 0));
    head += body;
    if (data) {
      slices.emplace_back(head);
      head.clear();
      slices.push_back(AnswerSlice(std::move(bytes)));
    }
  }
  if (!head.empty() || slices.empty()) slices.emplace_back(head);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeAnswer(AttendAnswer* answer) {
  if (answer->meta.steps_size() > 0) return EncodeSteps(answer);
  return EncodeResponse(answer->meta, {std::move(answer->output), std::move(answer->output_block)},
                        std::move(answer->weights));
}

}  // namespace attnserve
