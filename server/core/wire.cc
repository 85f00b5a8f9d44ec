#include "server/core/wire.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "server/core/checked_math.h"

namespace attnserve {
namespace {

Status ViewOf(const char* field, const pb::Tensor& t, TensorView* view) {
  switch (t.dtype()) {
    case pb::DATA_TYPE_FLOAT32:
      view->dtype = DType::kFloat32;
      break;
    case pb::DATA_TYPE_FLOAT16:
      view->dtype = DType::kFloat16;
      break;
    case pb::DATA_TYPE_BFLOAT16:
      view->dtype = DType::kBFloat16;
      break;
    case pb::DATA_TYPE_BOOL:
      view->dtype = DType::kBool;
      break;
    default:
      return InvalidArgument(std::string(field) + ": dtype " + std::to_string(t.dtype()) +
                             " is not allowed; expected FLOAT32, FLOAT16, BFLOAT16 or BOOL");
  }
  view->shape.assign(t.shape().begin(), t.shape().end());
  if (view->shape.empty()) {
    return InvalidArgument(std::string(field) +
                           ": shape is empty; expected at least one dimension");
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
    case pb::LAYOUT_BATCH_FIRST:
      call->layout = TensorLayout::kBatchFirst;
      return Status::Ok();
    case pb::LAYOUT_SEQUENCE_FIRST:
      call->layout = TensorLayout::kSequenceFirst;
      return Status::Ok();
    default:
      return InvalidArgument("layout: " + std::to_string(layout) +
                             " is not allowed; expected BATCH_FIRST (1) or SEQUENCE_FIRST (2)");
  }
}

}  // namespace

Status OutputLimits::Check(const AttendCall& call) const {
  for (const auto& [bound, need, what] :
       {std::tuple<const Bound&, int64_t, const char*>{output, call.output_bytes, "output"},
        std::tuple<const Bound&, int64_t, const char*>{weights, call.weights_bytes, "weights"}}) {
    if (bound.bytes >= 0 && need > bound.bytes) {
      return InvalidArgument(
          bound.field + ": " + std::to_string(bound.bytes) + " bytes given for the " + what +
          ", which needs " + std::to_string(need) + " (shape " +
          ShapeString(std::string(what) == "output" ? call.output_shape : call.weights_shape) +
          ")");
    }
  }
  return Status::Ok();
}

void UseStaged(const StagedInputs& staged, AttendCall* call) {
  const auto use = [](const BlockBytes& b, TensorView* v) {
    if (!b || v == nullptr) return;
    v->data = b.data;
    v->nbytes = b.size;
    v->pinned = true;
  };
  use(staged.query, &call->query);
  use(staged.key, call->key ? &*call->key : nullptr);
  use(staged.value, call->value ? &*call->value : nullptr);
}

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
    case pb::ATTN_WEIGHTS_NONE:
      call->weights = WeightsMode::kNone;
      break;
    case pb::ATTN_WEIGHTS_AVERAGED:
      call->weights = WeightsMode::kAveraged;
      break;
    case pb::ATTN_WEIGHTS_PER_HEAD:
      call->weights = WeightsMode::kPerHead;
      break;
    default:
      return InvalidArgument("attn_weights: " + std::to_string(r.attn_weights()) +
                             " is not allowed; expected NONE (0), AVERAGED (1) or PER_HEAD (2)");
  }
  RETURN_IF_ERROR(LayoutFromWire(r.layout(), call));
  if (!r.session().empty()) call->is_causal = true;  // A session's steps are causal.
  if (r.has_query_position()) call->query_position = r.query_position();
  call->key_position = r.key_position();
  call->positions.assign(r.positions().begin(), r.positions().end());
  return Status::Ok();
}

Status CheckBatchedStep(const pb::AttendRequest& r) {
  std::vector<std::string> set;
  const auto no = [&](bool present, const char* field) {
    if (present) set.push_back(field);
  };
  no(r.has_query(), "query");
  no(r.has_key(), "key");
  no(r.has_value(), "value");
  no(r.has_key_padding_mask(), "key_padding_mask");
  no(r.has_attn_mask(), "attn_mask");
  no(r.is_causal(), "is_causal");
  no(r.attn_weights() != pb::ATTN_WEIGHTS_NONE, "attn_weights");
  no(r.layout() == pb::LAYOUT_SEQUENCE_FIRST, "layout");
  no(!r.memory().empty(), "memory");
  no(!r.session().empty(), "session");
  no(r.has_session_length(), "session_length");
  no(r.has_output_shared_memory(), "output_shared_memory");
  no(r.has_attn_weights_shared_memory(), "attn_weights_shared_memory");
  no(r.has_query_position(), "query_position");
  no(r.key_position() != 0, "key_position");
  no(r.positions_size() > 0, "positions");
  if (set.empty()) return Status::Ok();
  std::string fields;
  for (const std::string& f : set) fields += (fields.empty() ? "" : ", ") + f;
  return InvalidArgument(fields +
                         ": set on a batched step (steps: " + std::to_string(r.steps_size()) +
                         " entries); each entry carries its own query, handle and positions, and "
                         "the request none (docs/api.md \"Many sessions in one call\")");
}

Status FromWire(const pb::Step& s, const std::string& field, AttendCall* call) {
  if (s.session().empty() == s.memory().empty()) {
    return InvalidArgument(field + ": names " +
                           (s.session().empty() ? std::string("neither a session nor a memory")
                                                : std::string("both a session and a memory")) +
                           "; expected exactly one of session, memory");
  }
  if (!s.has_query()) return InvalidArgument(field + ".query: missing; expected a tensor");
  const std::string query = field + ".query";
  if (s.query().has_shared_memory()) {
    return InvalidArgument(query +
                           ".shared_memory: set; a batched step's queries travel in the message");
  }
  RETURN_IF_ERROR(ViewOf(query.c_str(), s.query(), &call->query));
  const std::string kpm = field + ".key_padding_mask";
  RETURN_IF_ERROR(OptionalView(kpm.c_str(), s.has_key_padding_mask(), s.key_padding_mask(),
                               &call->key_padding_mask));
  if (call->key_padding_mask && !s.memory().empty()) {
    return InvalidArgument(kpm + ": set on a memory's entry; a memory keeps its own padding");
  }
  call->layout = TensorLayout::kBatchFirst;
  call->is_causal = !s.session().empty();  // A session's steps are causal.
  if (s.has_query_position()) call->query_position = s.query_position();
  call->positions.assign(s.positions().begin(), s.positions().end());
  return Status::Ok();
}

Status FromWire(const pb::CreateMemoryRequest& r, AttendCall* call) {
  RETURN_IF_ERROR(OptionalView("key", r.has_key(), r.key(), &call->key));
  RETURN_IF_ERROR(OptionalView("value", r.has_value(), r.value(), &call->value));
  RETURN_IF_ERROR(OptionalView("key_padding_mask", r.has_key_padding_mask(), r.key_padding_mask(),
                               &call->key_padding_mask));
  call->key_position = r.key_position();
  return LayoutFromWire(r.layout(), call);
}

pb::DataType ToWire(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return pb::DATA_TYPE_FLOAT32;
    case DType::kFloat16:
      return pb::DATA_TYPE_FLOAT16;
    case DType::kBFloat16:
      return pb::DATA_TYPE_BFLOAT16;
    case DType::kBool:
      return pb::DATA_TYPE_BOOL;
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
  info->set_num_kv_heads(s.kv_heads());
  info->set_head_dim(s.head_dim());
  info->set_scale(s.decoder && s.decoder->scale > 0
                      ? s.decoder->scale
                      : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(1, s.head_dim()))));
  if (!s.decoder) return;
  const DecoderSpec& d = *s.decoder;
  info->set_family(d.family);
  info->set_layer(d.layer);
  info->set_sliding_window(d.sliding_window);
  info->set_qk_norm(d.qk_norm);
  if (d.rotary) {
    info->set_rotary_theta(d.rotary->theta);
    info->set_rotary_dim(d.rotary->rotary_dim);
    info->set_rope_type(d.rotary->type);
  }
}

namespace {

// The bytes a tensor's dtype and shape take; nullopt when a dimension is negative or the product
// overflows int64 (0 for an unspecified dtype).
std::optional<int64_t> DeclaredBytes(const pb::Tensor& t) {
  const int64_t element =
      t.dtype() == pb::DATA_TYPE_FLOAT32                                          ? 4
      : t.dtype() == pb::DATA_TYPE_FLOAT16 || t.dtype() == pb::DATA_TYPE_BFLOAT16 ? 2
      : t.dtype() == pb::DATA_TYPE_BOOL                                           ? 1
                                                                                  : 0;
  std::optional<int64_t> bytes = element;
  for (int64_t d : t.shape()) {
    if (d < 0 || !bytes) return std::nullopt;
    bytes = CheckedMul({*bytes, d});
  }
  return bytes;
}

}  // namespace

Status CheckTensorWindow(const pb::Tensor& tensor, int64_t window_bytes, const std::string& field) {
  const std::optional<int64_t> declared = DeclaredBytes(tensor);
  if (declared && *declared == window_bytes) return Status::Ok();
  std::string shape;
  for (int64_t d : tensor.shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
  return InvalidArgument(field + ": byte_size " + std::to_string(window_bytes) +
                         ", but the tensor's dtype " + pb::DataType_Name(tensor.dtype()) +
                         " and shape [" + shape + "] take " +
                         (declared ? std::to_string(*declared) + " bytes"
                                   : std::string("more bytes than int64 counts")) +
                         "; the window must hold exactly the tensor");
}

}  // namespace attnserve
