#include "server/protocol/oip_codec.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include "server/core/checked_math.h"

namespace attnserve {
namespace {

using inference::InferParameter;

constexpr const char* kPositions = "positions";

StatusOr<v1::DataType> DataTypeFromOip(const std::string& field, const std::string& name) {
  static const std::map<std::string, v1::DataType> kTypes = {{"FP32", v1::DATA_TYPE_FLOAT32},
                                                             {"FP16", v1::DATA_TYPE_FLOAT16},
                                                             {"BF16", v1::DATA_TYPE_BFLOAT16},
                                                             {"BOOL", v1::DATA_TYPE_BOOL}};
  auto it = kTypes.find(name);
  if (it != kTypes.end()) return it->second;
  return InvalidArgument(field + ": '" + name +
                         "' is not allowed; expected FP32, FP16, BF16 or BOOL");
}

// The AttendRequest field an input name stands for.
v1::Tensor* InputField(const std::string& name, v1::AttendRequest* out) {
  if (name == "query") return out->mutable_query();
  if (name == "key") return out->mutable_key();
  if (name == "value") return out->mutable_value();
  if (name == "key_padding_mask") return out->mutable_key_padding_mask();
  if (name == "attn_mask") return out->mutable_attn_mask();
  return nullptr;
}

const char* KindOf(const InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case InferParameter::kBoolParam:
      return "bool";
    case InferParameter::kInt64Param:
      return "int64";
    case InferParameter::kStringParam:
      return "string";
    case InferParameter::kDoubleParam:
      return "double";
    case InferParameter::kUint64Param:
      return "uint64";
    default:
      return "empty";
  }
}

Status WrongKind(const std::string& name, const InferParameter& p, const char* expected) {
  return InvalidArgument("parameters['" + name + "']: a " + KindOf(p) + " parameter; expected " +
                         expected);
}

// Rotary models: the position of the first query (key) token; the validator bounds it.
Status ApplyPosition(const std::string& name, const InferParameter& p, v1::AttendRequest* out) {
  if (p.parameter_choice_case() != InferParameter::kInt64Param) return WrongKind(name, p, "int64");
  if (name == "query_position") {
    out->set_query_position(p.int64_param());
  } else {
    out->set_key_position(p.int64_param());
  }
  return Status::Ok();
}

// One request parameter into the AttendRequest.
Status ApplyParameter(const std::string& name, const InferParameter& p, v1::AttendRequest* out) {
  const bool is_string = p.parameter_choice_case() == InferParameter::kStringParam;
  if (name == "is_causal") {
    if (p.parameter_choice_case() != InferParameter::kBoolParam) return WrongKind(name, p, "bool");
    out->set_is_causal(p.bool_param());
  } else if (name == "attn_weights") {
    if (!is_string) return WrongKind(name, p, "string: none, averaged or per_head");
    const std::string& v = p.string_param();
    if (v == "none")
      out->set_attn_weights(v1::ATTN_WEIGHTS_NONE);
    else if (v == "averaged")
      out->set_attn_weights(v1::ATTN_WEIGHTS_AVERAGED);
    else if (v == "per_head")
      out->set_attn_weights(v1::ATTN_WEIGHTS_PER_HEAD);
    else
      return InvalidArgument("parameters['attn_weights']: '" + v +
                             "'; allowed: none, averaged, per_head");
  } else if (name == "layout") {
    if (!is_string) return WrongKind(name, p, "string: batch_first or sequence_first");
    const std::string& v = p.string_param();
    if (v == "batch_first")
      out->set_layout(v1::LAYOUT_BATCH_FIRST);
    else if (v == "sequence_first")
      out->set_layout(v1::LAYOUT_SEQUENCE_FIRST);
    else
      return InvalidArgument("parameters['layout']: '" + v +
                             "'; allowed: batch_first, sequence_first");
  } else if (name == "memory" || name == "session") {
    if (!is_string) return WrongKind(name, p, "string: a handle from CreateMemory or OpenSession");
    (name == "memory" ? *out->mutable_memory() : *out->mutable_session()) = p.string_param();
  } else if (name == "session_length") {
    if (p.parameter_choice_case() != InferParameter::kInt64Param)
      return WrongKind(name, p, "int64");
    out->set_session_length(p.int64_param());
  } else if (name == "query_position" || name == "key_position") {
    return ApplyPosition(name, p, out);
  } else if (name == "priority" || name == "timeout") {
    // tritonclient's priority= (uint64) and timeout= (int64, microseconds): either kind, >= 0.
    const auto kind = p.parameter_choice_case();
    uint64_t v = 0;
    if (kind == InferParameter::kUint64Param) {
      v = p.uint64_param();
    } else if (kind == InferParameter::kInt64Param) {
      if (p.int64_param() < 0) {
        return InvalidArgument("parameters['" + name + "']: " + std::to_string(p.int64_param()) +
                               "; allowed: 0 or more");
      }
      v = static_cast<uint64_t>(p.int64_param());
    } else {
      return WrongKind(name, p, "uint64 or int64 >= 0");
    }
    if (name == "priority") {
      out->set_priority(v);
    } else {
      out->set_queue_timeout_us(v);
    }
  } else if (name == "sequence_id" || name == "sequence_start" || name == "sequence_end") {
    return Status::Ok();  // SequenceOf reads them.
  } else if (name == "traceparent" || name == "tracestate") {
    // A request's own W3C trace context (a stream's requests may each carry one); a malformed
    // value is ignored, as the spec says, and so is one of the wrong kind.
    if (is_string) {
      (name == "traceparent" ? *out->mutable_traceparent() : *out->mutable_tracestate()) =
          p.string_param();
    }
  } else {
    return InvalidArgument(
        "parameters['" + name +
        "']: not a parameter of attnserve; allowed: is_causal, attn_weights, layout, "
        "memory, session, session_length, query_position, key_position, priority, timeout, "
        "traceparent, tracestate");
  }
  return Status::Ok();
}

// An input's parameters: binary_data_size (what HTTP clients and KServe's SDK send along with
// raw bytes) is taken and ignored; the shared-memory ones name a region.
Status CheckInputParameters(const std::string& field,
                            const inference::ModelInferRequest::InferInputTensor& t) {
  for (const auto& [name, p] : t.parameters()) {
    if (name == "binary_data_size" || name == "shared_memory_region" ||
        name == "shared_memory_byte_size" || name == "shared_memory_offset")
      continue;  // The last three: RegionOf.
    return InvalidArgument(field + ".parameters['" + name +
                           "']: not an input parameter of attnserve");
  }
  return Status::Ok();
}

// Typed contents as the raw bytes the native API takes: FP32 from fp32_contents, BOOL from
// bool_contents (one byte each).
Status TypedBytes(const std::string& field, v1::DataType dtype,
                  const inference::InferTensorContents& c, std::string* bytes) {
  if (dtype == v1::DATA_TYPE_FLOAT32) {
    bytes->assign(reinterpret_cast<const char*>(c.fp32_contents().data()),
                  c.fp32_contents_size() * sizeof(float));
    return Status::Ok();
  }
  if (dtype == v1::DATA_TYPE_BOOL) {
    bytes->resize(c.bool_contents_size());
    for (int i = 0; i < c.bool_contents_size(); ++i) (*bytes)[i] = c.bool_contents(i) ? 1 : 0;
    return Status::Ok();
  }
  return InvalidArgument(
      field +
      ".contents: FP16 and BF16 have no typed contents in the protocol; send the "
      "bytes in raw_input_contents");
}

// The "positions" input (rotary models: one position per query token, [batch, query_len] or
// [query_len]) as AttendRequest.positions: INT64, from raw bytes (little-endian) or int64_contents,
// never from shared memory.
Status TakePositions(const std::string& field,
                     const inference::ModelInferRequest::InferInputTensor& t, std::string* raw,
                     v1::AttendRequest* out) {
  if (t.datatype() != "INT64") {
    return InvalidArgument(field + ".datatype: '" + t.datatype() +
                           "' is not allowed for positions; expected INT64");
  }
  if (t.parameters().count("shared_memory_region")) {
    return InvalidArgument(field +
                           ": positions come in the request (raw_input_contents or "
                           "contents.int64_contents), not from shared memory");
  }
  if (t.shape_size() < 1 || t.shape_size() > 2) {
    return InvalidArgument(field + ".shape: " + std::to_string(t.shape_size()) +
                           " dims; positions are [batch, query_len] or [query_len]");
  }
  const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  const std::optional<int64_t> count =
      CheckedMul({shape[0], shape.size() == 2 ? shape[1] : int64_t{1}});
  if (shape[0] < 0 || shape.back() < 0 || !count) {
    return InvalidArgument(field + ".shape: " + ShapeString(shape) +
                           " is not a size; each dim is 0 or more, their product an int64");
  }
  auto* positions = out->mutable_positions();
  if (raw != nullptr) {
    if (t.has_contents()) {
      return InvalidArgument(field +
                             ".contents: given with raw_input_contents; send one or the other");
    }
    if (raw->size() % 8 != 0 ||
        static_cast<uint64_t>(raw->size() / 8) != static_cast<uint64_t>(*count)) {
      return InvalidArgument(field + ": " + std::to_string(raw->size()) + " bytes for shape " +
                             ShapeString(shape) + "; expected " + std::to_string(*count) +
                             " INT64 values, 8 bytes each");
    }
    positions->Resize(static_cast<int>(*count), 0);
    if (*count > 0) std::memcpy(positions->mutable_data(), raw->data(), raw->size());
    return Status::Ok();
  }
  if (t.contents().int64_contents_size() != *count) {
    return InvalidArgument(
        field + ".contents.int64_contents: " + std::to_string(t.contents().int64_contents_size()) +
        " values for shape " + ShapeString(shape) + "; expected " + std::to_string(*count));
  }
  *positions = t.contents().int64_contents();
  return Status::Ok();
}

// Triton's sequence parameters, when there are any.
StatusOr<std::optional<OipSequence>> SequenceOf(const inference::ModelInferRequest& in,
                                                const v1::AttendRequest& out) {
  const auto& params = in.parameters();
  const auto flag = [&](const char* name, bool* value) -> Status {
    auto it = params.find(name);
    if (it == params.end()) return Status::Ok();
    if (it->second.parameter_choice_case() != InferParameter::kBoolParam)
      return WrongKind(name, it->second, "bool");
    *value = it->second.bool_param();
    return Status::Ok();
  };
  OipSequence seq;
  RETURN_IF_ERROR(flag("sequence_start", &seq.start));
  RETURN_IF_ERROR(flag("sequence_end", &seq.end));
  auto id = params.find("sequence_id");
  if (id == params.end()) {
    if (params.count("sequence_start") || params.count("sequence_end")) {
      return InvalidArgument(
          "parameters['sequence_start'], ['sequence_end']: need parameters['sequence_id']");
    }
    return std::optional<OipSequence>();
  }
  switch (id->second.parameter_choice_case()) {
    case InferParameter::kInt64Param:
      seq.id = "i:" + std::to_string(id->second.int64_param());
      break;
    case InferParameter::kUint64Param:
      seq.id = "i:" + std::to_string(id->second.uint64_param());
      break;
    case InferParameter::kStringParam:
      seq.id = "s:" + id->second.string_param();
      break;
    default:
      return WrongKind("sequence_id", id->second, "int64, uint64 or string");
  }
  if (seq.id == "i:0" || seq.id == "s:") {
    return InvalidArgument(
        "parameters['sequence_id']: 0 and \"\" mean no sequence; send none, or another id");
  }
  if (!out.session().empty() || !out.memory().empty()) {
    return InvalidArgument(
        "parameters['sequence_id']: a sequence is a session of its own; not with parameters['" +
        std::string(out.session().empty() ? "memory" : "session") + "']");
  }
  if (out.model().empty())
    return InvalidArgument("model_name: empty; a sequence needs its model named");
  return std::optional<OipSequence>(seq);
}

}  // namespace

int64_t OipBatchOf(const v1::AttendRequest& request) {
  const auto& shape = request.query().shape();
  if (shape.size() != 3) return 1;
  return request.layout() == v1::LAYOUT_SEQUENCE_FIRST ? shape[1] : shape[0];
}

StatusOr<int64_t> OipVersion(const std::string& version) {
  if (version.empty()) return int64_t{0};
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(version.c_str(), &end, 10);
  if (errno != 0 || end == version.c_str() || *end != '\0' || v < 1) {
    return InvalidArgument("model_version: '" + version +
                           "'; allowed: \"\" (the highest loaded) or a loaded version number");
  }
  return static_cast<int64_t>(v);
}

const char* OipDatatype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "FP32";
    case DType::kFloat16:
      return "FP16";
    case DType::kBFloat16:
      return "BF16";
    case DType::kBool:
      return "BOOL";
  }
  return "FP32";
}

namespace {

using InputTensor = inference::ModelInferRequest::InferInputTensor;
using Parameters = google::protobuf::Map<std::string, inference::InferParameter>;

// A tensor's shared-memory parameters (Triton's): a region name and a byte size, both or neither,
// and an optional offset. Nothing when the tensor names no region.
StatusOr<std::optional<OipRegion>> RegionOf(const std::string& field, const Parameters& params,
                                            const TenantRegions* shm) {
  const auto region = params.find("shared_memory_region");
  const auto size = params.find("shared_memory_byte_size");
  const auto offset = params.find("shared_memory_offset");
  if (region == params.end() && size == params.end() && offset == params.end())
    return std::optional<OipRegion>();
  if (region == params.end() || size == params.end()) {
    return InvalidArgument(field +
                           ".parameters: shared_memory_region and shared_memory_byte_size go "
                           "together; one is missing");
  }
  if (region->second.parameter_choice_case() != inference::InferParameter::kStringParam)
    return WrongKind("shared_memory_region", region->second, "string");
  const auto integer = [&](const inference::InferParameter& p, const char* name,
                           int64_t* v) -> Status {
    if (p.parameter_choice_case() == inference::InferParameter::kInt64Param) {
      *v = p.int64_param();
    } else if (p.parameter_choice_case() == inference::InferParameter::kUint64Param &&
               p.uint64_param() <= static_cast<uint64_t>(INT64_MAX)) {
      *v = static_cast<int64_t>(p.uint64_param());
    } else {
      return WrongKind(name, p, "int64 (at most 2^63 - 1)");
    }
    return Status::Ok();
  };
  OipRegion r;
  RETURN_IF_ERROR(integer(size->second, "shared_memory_byte_size", &r.byte_size));
  if (offset != params.end())
    RETURN_IF_ERROR(integer(offset->second, "shared_memory_offset", &r.offset));
  if (shm == nullptr) {
    return Status(StatusCode::kFailedPrecondition,
                  field + ": shared memory is off on this server (--allow-shared-memory)");
  }
  ASSIGN_OR_RETURN(r.region, shm->Find(region->second.string_param()));
  RETURN_IF_ERROR(r.region->Check(r.offset, r.byte_size, field));
  return std::optional<OipRegion>(std::move(r));
}

// The inputs into `out`'s tensors: raw contents (one per input not in shared memory, in order),
// typed contents, or a region's bytes.
Status TakeInputs(inference::ModelInferRequest* in, v1::AttendRequest* out, OipReply* reply,
                  const TenantRegions* shm, int64_t max_region_bytes) {
  // The inputs in regions, read once every window is checked against its tensor and all of them
  // against the limit (nothing is read for a request that would be refused).
  struct Pending {
    std::string field;
    v1::Tensor* target;
    OipRegion region;
  };
  std::vector<Pending> pending;
  int64_t region_bytes = 0;
  int shared = 0;
  for (const InputTensor& t : in->inputs()) shared += t.parameters().count("shared_memory_region");
  const int raw_wanted = in->inputs_size() - shared;
  const bool raw = in->raw_input_contents_size() > 0;
  if (raw && in->raw_input_contents_size() != raw_wanted) {
    return InvalidArgument("raw_input_contents: " + std::to_string(in->raw_input_contents_size()) +
                           " entries for " + std::to_string(raw_wanted) +
                           " inputs not in shared memory; expected one per such input, in order");
  }
  std::set<std::string> seen;
  for (int i = 0, next_raw = 0; i < in->inputs_size(); ++i) {
    InputTensor* t = in->mutable_inputs(i);
    const std::string field = "inputs[" + std::to_string(i) + "]";
    v1::Tensor* target = InputField(t->name(), out);
    if (target == nullptr && t->name() != kPositions) {
      return InvalidArgument(field + ".name: '" + t->name() +
                             "' is not an input; allowed: query, key, value, key_padding_mask, "
                             "attn_mask, positions");
    }
    if (!seen.insert(t->name()).second) {
      return InvalidArgument(field + ".name: '" + t->name() + "' given twice");
    }
    RETURN_IF_ERROR(CheckInputParameters(field, *t));
    if (target == nullptr) {
      std::string* bytes = raw && !t->parameters().count("shared_memory_region")
                               ? in->mutable_raw_input_contents(next_raw++)
                               : nullptr;
      RETURN_IF_ERROR(TakePositions(field, *t, bytes, out));
      continue;
    }
    ASSIGN_OR_RETURN(const v1::DataType dtype, DataTypeFromOip(field + ".datatype", t->datatype()));
    ASSIGN_OR_RETURN(std::optional<OipRegion> region, RegionOf(field, t->parameters(), shm));
    target->set_dtype(dtype);
    target->mutable_shape()->Swap(t->mutable_shape());
    if (region) {
      RETURN_IF_ERROR(CheckTensorWindow(*target, region->byte_size,
                                        field + ".parameters.shared_memory_byte_size"));
      region_bytes = CheckedAdd(region_bytes, region->byte_size).value_or(INT64_MAX);
      pending.push_back({field, target, std::move(*region)});
    } else if (raw) {
      if (t->has_contents()) {
        return InvalidArgument(field +
                               ".contents: given with raw_input_contents; send one or the other");
      }
      target->mutable_data()->swap(*in->mutable_raw_input_contents(next_raw++));
    } else {
      RETURN_IF_ERROR(TypedBytes(field, dtype, t->contents(), target->mutable_data()));
    }
  }
  RETURN_IF_ERROR(CheckRegionInputBytes(region_bytes, max_region_bytes));
  for (Pending& p : pending) {
    // The region's bytes, read once into the request (a cut-short region: an error, not SIGBUS).
    p.target->mutable_data()->resize(static_cast<size_t>(p.region.byte_size));
    RETURN_IF_ERROR(p.region.region->Read(p.region.offset, p.region.byte_size,
                                          p.target->mutable_data()->data(), p.field));
    reply->regions.push_back(std::move(p.region.region));
  }
  return Status::Ok();
}

// The outputs asked for: all by default (attn_weights when the parameter asks for weights); asking
// for attn_weights asks for the averaged weights unless the parameter says which. An output may go
// to a shared-memory region.
Status TakeOutputs(const inference::ModelInferRequest& in, v1::AttendRequest* out, OipReply* reply,
                   const TenantRegions* shm) {
  reply->outputs.clear();
  reply->output_regions.clear();
  for (int i = 0; i < in.outputs_size(); ++i) {
    const std::string& name = in.outputs(i).name();
    const std::string field = "outputs[" + std::to_string(i) + "]";
    if (name != oip::kOutput && name != oip::kWeights) {
      return InvalidArgument(field + ".name: '" + name +
                             "' is not an output; allowed: attn_output, attn_weights");
    }
    if (std::find(reply->outputs.begin(), reply->outputs.end(), name) != reply->outputs.end())
      return InvalidArgument(field + ".name: '" + name + "' given twice");
    ASSIGN_OR_RETURN(std::optional<OipRegion> region,
                     RegionOf(field, in.outputs(i).parameters(), shm));
    if (region) RETURN_IF_ERROR(region->region->CheckWritable(field));
    reply->outputs.push_back(name);
    reply->output_regions.push_back(std::move(region));
    if (name == oip::kWeights && !in.parameters().count("attn_weights")) {
      out->set_attn_weights(v1::ATTN_WEIGHTS_AVERAGED);
    } else if (name == oip::kWeights && out->attn_weights() == v1::ATTN_WEIGHTS_NONE) {
      return InvalidArgument(
          "outputs: attn_weights asked for while parameters['attn_weights'] is 'none'");
    }
  }
  if (reply->outputs.empty()) {
    reply->outputs.push_back(oip::kOutput);
    if (out->attn_weights() != v1::ATTN_WEIGHTS_NONE) reply->outputs.push_back(oip::kWeights);
    reply->output_regions.resize(reply->outputs.size());
  }
  return Status::Ok();
}

}  // namespace

namespace {

// The positions input's shape against the query's: [batch, query_len] (batch-first whatever the
// layout), or [query_len] for one sequence. Its count alone would let [6] stand for [2, 3].
Status CheckPositionsShape(const inference::ModelInferRequest& in, const v1::AttendRequest& out) {
  const auto& q = out.query().shape();
  if (q.size() != 2 && q.size() != 3) return Status::Ok();  // The validator refuses the query.
  const bool seq_first = out.layout() == v1::LAYOUT_SEQUENCE_FIRST;
  const int64_t batch = q.size() == 2 ? 1 : q[seq_first ? 1 : 0];
  const int64_t len = q.size() == 2 ? q[0] : q[seq_first ? 0 : 1];
  for (int i = 0; i < in.inputs_size(); ++i) {
    if (in.inputs(i).name() != kPositions) continue;
    const std::vector<int64_t> shape(in.inputs(i).shape().begin(), in.inputs(i).shape().end());
    if (shape == std::vector<int64_t>{batch, len} ||
        (batch == 1 && shape == std::vector<int64_t>{len}))
      return Status::Ok();
    return InvalidArgument(
        "inputs[" + std::to_string(i) + "].shape: " + ShapeString(shape) +
        " for a query of batch " + std::to_string(batch) + " and " + std::to_string(len) +
        " tokens; positions are [batch, query_len] = " + ShapeString({batch, len}) +
        " (batch-first whatever the layout)" + (batch == 1 ? ", or [query_len]" : ""));
  }
  return Status::Ok();
}

}  // namespace

Status OipToAttend(inference::ModelInferRequest* in, v1::AttendRequest* out, OipReply* reply,
                   const TenantRegions* shm, int64_t max_region_bytes) {
  out->set_model(in->model_name());
  reply->id = in->id();
  ASSIGN_OR_RETURN(const int64_t version, OipVersion(in->model_version()));
  out->set_model_version(version);
  RETURN_IF_ERROR(TakeInputs(in, out, reply, shm, max_region_bytes));
  for (const auto& [name, p] : in->parameters()) RETURN_IF_ERROR(ApplyParameter(name, p, out));
  RETURN_IF_ERROR(CheckPositionsShape(*in, *out));
  ASSIGN_OR_RETURN(reply->sequence, SequenceOf(*in, *out));
  return TakeOutputs(*in, out, reply, shm);
}

OutputLimits OipOutputLimits(const OipReply& reply) {
  OutputLimits limits;
  for (size_t i = 0; i < reply.outputs.size(); ++i) {
    if (!reply.output_regions[i]) continue;
    OutputLimits::Bound& bound = reply.outputs[i] == oip::kOutput ? limits.output : limits.weights;
    bound.bytes = reply.output_regions[i]->byte_size;
    bound.field = "outputs[" + std::to_string(i) + "] (shared memory region '" +
                  reply.output_regions[i]->region->info().name + "')";
  }
  return limits;
}

Status OipWriteSharedOutputs(AttendAnswer* answer, const OipReply& reply) {
  for (size_t i = 0; i < reply.outputs.size(); ++i) {
    const std::optional<OipRegion>& r = reply.output_regions[i];
    if (!r) continue;
    const bool output = reply.outputs[i] == oip::kOutput;
    const char* data = output && answer->output_block ? answer->output_block.data
                       : output                       ? answer->output->data()
                                                      : answer->weights->data();
    const size_t size = output && answer->output_block ? answer->output_block.size
                        : output                       ? answer->output->size()
                                                       : answer->weights->size();
    RETURN_IF_ERROR(r->region->Write(r->offset, data, static_cast<int64_t>(size),
                                     "outputs[" + std::to_string(i) + "]"));
    if (output) {
      answer->output.reset();
      answer->output_block = BlockBytes();
    } else {
      answer->weights.reset();
    }
  }
  return Status::Ok();
}

inference::ModelInferResponse OipResponseHead(const AttendAnswer& answer, const OipReply& reply) {
  inference::ModelInferResponse head;
  head.set_model_name(answer.meta.model());
  head.set_model_version(std::to_string(answer.meta.model_version()));
  head.set_id(reply.id);
  for (const std::string& name : reply.outputs) {
    const v1::Tensor& t = name == oip::kOutput ? answer.meta.output() : answer.meta.attn_weights();
    auto* o = head.add_outputs();
    o->set_name(name);
    o->set_datatype(t.dtype() == v1::DATA_TYPE_FLOAT16    ? "FP16"
                    : t.dtype() == v1::DATA_TYPE_BFLOAT16 ? "BF16"
                                                          : "FP32");
    o->mutable_shape()->CopyFrom(t.shape());
  }
  return head;
}

inference::ModelStreamInferResponse OipStreamError(const v1::AttendRequest& request,
                                                   const OipReply& reply, const Status& status,
                                                   const std::string& trace_id) {
  inference::ModelStreamInferResponse r;
  r.set_error_message(status.message());
  inference::ModelInferResponse* head = r.mutable_infer_response();
  head->set_model_name(request.model());
  if (request.model_version() > 0) head->set_model_version(std::to_string(request.model_version()));
  head->set_id(reply.id);
  (*head->mutable_parameters())["error_code"].set_string_param(StatusCodeName(status.code()));
  if (!trace_id.empty()) (*head->mutable_parameters())["trace_id"].set_string_param(trace_id);
  return r;
}

std::vector<AnswerBytes> OipRawOutputs(AttendAnswer* answer, const OipReply& reply) {
  std::vector<AnswerBytes> raw;
  for (const std::string& name : reply.outputs) {
    AnswerBytes bytes;
    if (name == oip::kOutput) {
      bytes.own = std::move(answer->output);
      bytes.block = std::move(answer->output_block);
    } else {
      bytes.own = std::move(answer->weights);
    }
    if (!bytes.own && !bytes.block) bytes.own = std::make_unique<std::string>();
    raw.push_back(std::move(bytes));
  }
  return raw;
}

inference::ModelMetadataResponse OipModelMetadata(const ModelSpec& spec,
                                                  const std::vector<int64_t>& versions) {
  inference::ModelMetadataResponse m;
  m.set_name(spec.name);
  for (int64_t v : versions) m.add_versions(std::to_string(v));
  // What the model computes: nn.MultiheadAttention, or a decoder layer's attention (grouped
  // heads, rotary positions; GetModel has its every field).
  m.set_platform(spec.decoder ? "attnserve_decoder_attention" : "attnserve_multihead_attention");
  // The compute dtype: a bfloat16 model takes BF16 and answers in it (half the bytes of FP32, no
  // conversion); every model takes FP32, FP16 and BF16 alike.
  const char* dtype = OipDatatype(spec.compute_dtype);
  const auto add = [](auto* list, const std::string& name, const char* type,
                      std::vector<int64_t> shape) {
    auto* t = list->Add();
    t->set_name(name);
    t->set_datatype(type);
    for (int64_t d : shape) t->add_shape(d);
  };
  // Batch-first shapes; sequence-first ([L, B, *]) and unbatched ([L, *]) are taken too.
  add(m.mutable_inputs(), "query", dtype, {-1, -1, spec.embed_dim});
  // A sliding window attends over its own tokens only: no key and value of the caller's.
  if (!spec.decoder || spec.decoder->sliding_window == 0) {
    add(m.mutable_inputs(), "key", dtype, {-1, -1, spec.kdim});
    add(m.mutable_inputs(), "value", dtype, {-1, -1, spec.vdim});
  }
  if (spec.decoder && spec.decoder->rotary) add(m.mutable_inputs(), kPositions, "INT64", {-1, -1});
  add(m.mutable_inputs(), "key_padding_mask", "BOOL", {-1, -1});
  add(m.mutable_inputs(), "attn_mask", "BOOL", {-1, -1});
  add(m.mutable_outputs(), oip::kOutput, dtype, {-1, -1, spec.embed_dim});
  add(m.mutable_outputs(), oip::kWeights, dtype, {-1, -1, -1});
  return m;
}

}  // namespace attnserve
