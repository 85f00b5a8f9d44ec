#include "server/core/validator.h"

#include <limits>
#include <string>

#include "server/core/checked_math.h"

namespace attnserve {
namespace {

// Counts made of request sizes (tokens, scores, bytes) saturate: one that overflows int64 is over
// every limit, and says so.
constexpr int64_t kOverflow = std::numeric_limits<int64_t>::max();
int64_t Count(std::optional<int64_t> n) { return n.value_or(kOverflow); }
std::string CountText(int64_t n) { return n == kOverflow ? "more than 2^63" : std::to_string(n); }

std::string Expected(const char* names[], const int64_t* dims, int rank) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += names[i];
    if (dims[i] > 0) s += "=" + std::to_string(dims[i]);
  }
  return s + "]";
}

// Checks every dim >= 1 and that the bytes hold exactly product(shape) elements of the dtype.
Status CheckStorage(const char* field, const TensorView& t) {
  int64_t numel = 1;
  for (int64_t d : t.shape) {
    if (d < 1) {
      return InvalidArgument(std::string(field) + ": shape " + ShapeString(t.shape) +
                             " has a dimension < 1; every dimension must be >= 1");
    }
    if (__builtin_mul_overflow(numel, d, &numel) || numel > (int64_t{1} << 40)) {
      return InvalidArgument(std::string(field) + ": shape " + ShapeString(t.shape) +
                             " has too many elements");
    }
  }
  const uint64_t want = static_cast<uint64_t>(numel) * DTypeSize(t.dtype);
  if (want != t.nbytes) {
    return InvalidArgument(std::string(field) + ": data has " + std::to_string(t.nbytes) +
                           " bytes, expected " + std::to_string(want) + " for shape " +
                           ShapeString(t.shape) + " of " + DTypeName(t.dtype));
  }
  return Status::Ok();
}

// Checks rank and, where `want[i] > 0`, the size of dim i.
Status CheckShape(const char* field, const TensorView& t, const char* names[], const int64_t* want,
                  int rank) {
  const std::string expected = Expected(names, want, rank);
  if (static_cast<int>(t.shape.size()) != rank) {
    return InvalidArgument(std::string(field) + ": shape " + ShapeString(t.shape) + " has " +
                           std::to_string(t.shape.size()) + " dims, expected " + expected);
  }
  for (int i = 0; i < rank; ++i) {
    if (want[i] > 0 && t.shape[i] != want[i]) {
      return InvalidArgument(std::string(field) + ": shape " + ShapeString(t.shape) + " has " +
                             names[i] + "=" + std::to_string(t.shape[i]) + ", expected " +
                             expected);
    }
  }
  return Status::Ok();
}

Status CheckMaskDtype(const char* field, const TensorView& t) {
  if (t.dtype == DType::kBool || IsFloating(t.dtype)) return Status::Ok();
  return InvalidArgument(std::string(field) + ": dtype " + DTypeName(t.dtype) +
                         " is not allowed; expected BOOL or a floating-point dtype");
}

// Indexes of the batch and length dims of a rank-3 input in `layout`.
struct Axes {
  int batch;
  int len;
};

// Key and value of a batched or unbatched call (batch: call->batch, or any when 0); sets key_len.
Status CheckKeyValue(const ModelSpec& model, AttendCall* call) {
  // CreateMemory has no query: the key sets the dtype.
  const bool create = call->kv_use == AttendCall::Kv::kCreateMemory;
  const TensorView& q = create ? *call->key : call->query;
  const bool batch_first = call->layout == TensorLayout::kBatchFirst;
  const Axes axes = batch_first ? Axes{0, 1} : Axes{1, 0};
  const int rank = call->batched ? 3 : 2;
  int64_t key_len = 0;
  for (int which = 0; which < 2; ++which) {
    const char* field = which == 0 ? "key" : "value";
    const TensorView& t = which == 0 ? *call->key : *call->value;
    const int64_t feat = which == 0 ? model.kdim : model.vdim;
    const char* feat_name = which == 0 ? "kdim" : "vdim";
    if (t.dtype != q.dtype) {
      return InvalidArgument(std::string(field) + ": dtype " + DTypeName(t.dtype) +
                             " differs from " + (create ? "the key's " : "the query's ") +
                             DTypeName(q.dtype) +
                             (create ? "; key and value must share one dtype"
                                     : "; query, key and value must share one dtype"));
    }
    // For value, the length must equal the key's.
    if (call->batched) {
      const char* names[3] = {batch_first ? "batch" : "key_len", batch_first ? "key_len" : "batch",
                              feat_name};
      int64_t want[3];
      want[axes.batch] = call->batch;
      want[axes.len] = key_len;
      want[2] = feat;
      RETURN_IF_ERROR(CheckShape(field, t, names, want, rank));
      key_len = t.shape[axes.len];
      if (call->batch == 0) call->batch = t.shape[axes.batch];  // CreateMemory: the key's batch
    } else {
      const char* names[2] = {"key_len", feat_name};
      const int64_t want[2] = {key_len, feat};
      RETURN_IF_ERROR(CheckShape(field, t, names, want, rank));
      key_len = t.shape[0];
    }
    RETURN_IF_ERROR(CheckStorage(field, t));
  }
  call->key_len = key_len;
  return Status::Ok();
}

// key_padding_mask: [B, Lk] (unbatched [Lk]); a session step's covers its new tokens only.
Status CheckKeyPadding(const AttendCall* call) {
  if (!call->key_padding_mask) return Status::Ok();
  const TensorView& m = *call->key_padding_mask;
  RETURN_IF_ERROR(CheckMaskDtype("key_padding_mask", m));
  const bool session = call->kv_use == AttendCall::Kv::kSession;
  const char* len_name = session ? "new_tokens" : "key_len";
  const int64_t len = session ? call->query_len : call->key_len;
  if (call->batched) {
    const char* names[2] = {"batch", len_name};
    const int64_t want[2] = {call->batch, len};
    RETURN_IF_ERROR(CheckShape("key_padding_mask", m, names, want, 2));
  } else {
    const char* names[1] = {len_name};
    const int64_t want[1] = {len};
    RETURN_IF_ERROR(CheckShape("key_padding_mask", m, names, want, 1));
  }
  return CheckStorage("key_padding_mask", m);
}

// The query: dtype, rank, embed_dim, storage; sets batched, batch, query_len (key_len = query_len).
Status CheckQuery(const ModelSpec& model, AttendCall* call) {
  const TensorView& q = call->query;
  if (q.shape.empty()) return InvalidArgument("query: missing; expected a tensor");
  if (!IsFloating(q.dtype)) {
    return InvalidArgument(std::string("query: dtype ") + DTypeName(q.dtype) +
                           " is not allowed; expected FLOAT32, FLOAT16 or BFLOAT16");
  }
  const bool batch_first = call->layout == TensorLayout::kBatchFirst;
  const Axes axes = batch_first ? Axes{0, 1} : Axes{1, 0};
  const char* layout_names[3] = {batch_first ? "batch" : "query_len",
                                 batch_first ? "query_len" : "batch", "embed_dim"};
  const int64_t any = 0;
  if (q.shape.size() == 3) {
    const int64_t want[3] = {any, any, model.embed_dim};
    RETURN_IF_ERROR(CheckShape("query", q, layout_names, want, 3));
  } else if (q.shape.size() == 2) {
    const char* names[2] = {"query_len", "embed_dim"};
    const int64_t want[2] = {any, model.embed_dim};
    RETURN_IF_ERROR(CheckShape("query", q, names, want, 2));
  } else {
    const int64_t want[3] = {any, any, model.embed_dim};
    return InvalidArgument(
        "query: shape " + ShapeString(q.shape) + " has " + std::to_string(q.shape.size()) +
        " dims, expected " + Expected(layout_names, want, 3) +
        " or unbatched [query_len, embed_dim=" + std::to_string(model.embed_dim) + "]");
  }
  RETURN_IF_ERROR(CheckStorage("query", q));
  call->batched = q.shape.size() == 3;
  call->batch = call->batched ? q.shape[axes.batch] : 1;
  call->query_len = call->batched ? q.shape[axes.len] : q.shape[0];
  call->key_len = call->query_len;
  return Status::Ok();
}

// A call on a memory or session: it carries no key or value of its own, its batch is the kept
// one's; sets key_len to the keys it attends to (a session's: those held plus the new ones).
Status CheckKept(AttendCall* call) {
  const bool memory = call->kv_use == AttendCall::Kv::kMemory;
  const bool session = call->kv_use == AttendCall::Kv::kSession;
  if (!memory && !session) return Status::Ok();
  const std::string what = memory ? "memory" : "session";
  if (call->key || call->value) {
    return InvalidArgument(std::string(call->key ? "key" : "value") + ": a request naming a " +
                           what + " carries no key or value (the " + what + " holds them)");
  }
  if (memory && call->key_padding_mask) {
    return InvalidArgument(
        "key_padding_mask: a request naming a memory carries none (the memory has "
        "the one given to CreateMemory)");
  }
  if (call->batch != call->kv_batch) {
    return InvalidArgument("query: batch " + std::to_string(call->batch) + ", but the " + what +
                           " holds " + std::to_string(call->kv_batch) +
                           " sequence(s); send that many rows per step");
  }
  call->key_len = memory ? call->kv_length : Count(CheckedAdd(call->kv_length, call->query_len));
  return Status::Ok();
}

// Key and value both present (cross-attention) or both absent (self-attention, which needs
// kdim = vdim = embed_dim); sets key_len for cross-attention.
Status CheckKeyValuePair(const ModelSpec& model, AttendCall* call) {
  if (call->key.has_value() != call->value.has_value()) {
    return InvalidArgument(std::string(call->key ? "value" : "key") +
                           ": missing; key and value must be both present (cross-attention) or "
                           "both absent (self-attention)");
  }
  if (call->self_attention() && (model.kdim != model.embed_dim || model.vdim != model.embed_dim)) {
    return InvalidArgument("key: missing; model '" + model.name + "' has kdim=" +
                           std::to_string(model.kdim) + ", vdim=" + std::to_string(model.vdim) +
                           " != embed_dim=" + std::to_string(model.embed_dim) +
                           ", so it needs key and value (cross-attention)");
  }
  return call->key ? CheckKeyValue(model, call) : Status::Ok();
}

// attn_mask: [query_len, key_len], or [batch * num_heads (unbatched: num_heads), query_len,
// key_len].
Status CheckAttnMask(const ModelSpec& model, const AttendCall* call) {
  if (!call->attn_mask) return Status::Ok();
  const TensorView& m = *call->attn_mask;
  RETURN_IF_ERROR(CheckMaskDtype("attn_mask", m));
  if (m.shape.size() == 2) {
    const char* names[2] = {"query_len", "key_len"};
    const int64_t want[2] = {call->query_len, call->key_len};
    RETURN_IF_ERROR(CheckShape("attn_mask", m, names, want, 2));
  } else {
    const char* names[3] = {call->batched ? "batch*num_heads" : "num_heads", "query_len",
                            "key_len"};
    const int64_t want[3] = {Count(CheckedMul({call->batch, model.num_heads})), call->query_len,
                             call->key_len};
    Status st = CheckShape("attn_mask", m, names, want, 3);
    if (!st.ok()) {
      return InvalidArgument(st.message() + " or [query_len=" + std::to_string(call->query_len) +
                             ", key_len=" + std::to_string(call->key_len) + "]");
    }
  }
  return CheckStorage("attn_mask", m);
}

// The request's tokens and attention scores against the server's limits; sets tokens and
// attention_cost.
Status CheckSize(const ModelSpec& model, const AttendLimits& limits, AttendCall* call) {
  const int64_t tokens = Count(
      CheckedMul({call->batch, Count(CheckedAdd(call->query_len, call->key ? call->key_len : 0))}));
  call->tokens = tokens;
  call->attention_cost = Count(CheckedMul({call->batch, call->query_len, call->key_len}));
  if (tokens > limits.max_tokens) {
    return InvalidArgument(
        "request: " + CountText(tokens) +
        " tokens (batch * query_len, plus batch * key_len for cross-attention) is over the "
        "per-request limit of " +
        std::to_string(limits.max_tokens) + " (server flag --max-request-tokens)");
  }
  const int64_t scores = Count(CheckedMul({call->batch, model.num_heads, call->query_len,
                                           Count(CheckedAdd(call->key_len, model.extra_keys()))}));
  if (scores > limits.max_attention_scores) {
    return InvalidArgument(
        "request: " + CountText(scores) +
        " attention scores (batch * num_heads * query_len * key_len) is over the "
        "per-request limit of " +
        std::to_string(limits.max_attention_scores) + " (server flag --max-attention-scores)");
  }
  return Status::Ok();
}

// The answer's shapes and bytes (output, attention weights); refused now when they cannot fit in
// one message, rather than computed and then not sent.
Status PlanAnswer(const ModelSpec& model, const AttendLimits& limits, AttendCall* call) {
  const int64_t e = model.embed_dim, s = call->key_len + model.extra_keys();
  const DType dtype = call->query.dtype;
  const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
  const bool seq_first = call->layout == TensorLayout::kSequenceFirst;
  if (!call->batched) {
    call->output_shape = {call->query_len, e};
  } else {
    call->output_shape = seq_first ? std::vector<int64_t>{call->query_len, call->batch, e}
                                   : std::vector<int64_t>{call->batch, call->query_len, e};
  }
  call->weights_shape.clear();
  if (call->weights == WeightsMode::kPerHead)
    call->weights_shape = {call->batch, model.num_heads, call->query_len, s};
  if (call->weights == WeightsMode::kAveraged)
    call->weights_shape = {call->batch, call->query_len, s};
  if (!call->batched && !call->weights_shape.empty())
    call->weights_shape.erase(call->weights_shape.begin());
  // Below the two limits of CheckSize these cannot overflow, but they are request sizes all the
  // same.
  call->output_bytes = Count(CheckedMul({call->batch, call->query_len, e, elem}));
  call->weights_bytes = 0;
  if (!call->weights_shape.empty()) {
    call->weights_bytes = elem;
    for (int64_t d : call->weights_shape)
      call->weights_bytes = Count(CheckedMul({call->weights_bytes, d}));
  }
  const int64_t answer_bytes = Count(CheckedAdd(call->output_bytes, call->weights_bytes));
  if (answer_bytes <= limits.max_answer_bytes) return Status::Ok();
  std::string what = "output " + ShapeString(call->output_shape);
  if (call->weights_bytes) {
    what += std::string(" and ") +
            (call->weights == WeightsMode::kPerHead ? "PER_HEAD" : "AVERAGED") + " attn_weights " +
            ShapeString(call->weights_shape);
  }
  return InvalidArgument("answer: " + what + " of " + DTypeName(dtype) + " come to " +
                         CountText(answer_bytes) + " bytes, over the " +
                         std::to_string(limits.max_answer_bytes) +
                         " bytes one answer may carry (server flag --max-message-bytes); ask "
                         "for fewer tokens or fewer attention weights per request");
}

// Positions (rotary models only) and what a decoder's attention does not take.
Status CheckPositions(const ModelSpec& model, const AttendCall* call) {
  const bool rotary = model.decoder && model.decoder->rotary;
  const bool asked = call->query_position || call->key_position != 0 || !call->positions.empty();
  if (asked && !rotary) {
    return InvalidArgument("positions: model '" + model.name +
                           "' has no rotary positions; query_position, key_position and positions "
                           "are for models loaded from a decoder checkpoint");
  }
  if (model.decoder && model.decoder->sliding_window > 0 && !call->self_attention()) {
    return InvalidArgument("key: model '" + model.name + "' attends over a sliding window of " +
                           std::to_string(model.decoder->sliding_window) +
                           " tokens, which is defined for self-attention and sessions only; "
                           "cross-attention (key and value, or a memory) is refused");
  }
  if (!rotary) return Status::Ok();
  // Positions up to 2^31 - 1: an angle's float32 position is exact to 2^24 and transformers'
  // int64 positions are never near this; the sums below cannot overflow. The last of `len`
  // tokens from `first` is first + len - 1.
  constexpr int64_t kMaxPosition = (int64_t{1} << 31) - 1;
  const auto in_range = [&](const char* field, int64_t first, int64_t len) -> Status {
    if (first < 0 || first > kMaxPosition || len - 1 > kMaxPosition - first) {
      return InvalidArgument(std::string(field) + " is " + std::to_string(first) + " with " +
                             std::to_string(len) + " tokens; positions must lie in 0 to " +
                             std::to_string(kMaxPosition));
    }
    return Status::Ok();
  };
  if (call->query_position)
    RETURN_IF_ERROR(in_range("query_position", *call->query_position, call->query_len));
  if (call->key_position != 0) {
    if (call->self_attention()) {
      return InvalidArgument(
          "key_position: only for cross-attention (a key on the wire, or a "
          "memory's); self-attention's keys are at the queries' positions");
    }
    RETURN_IF_ERROR(in_range("key_position", call->key_position, call->key_len));
  }
  if (!call->positions.empty()) {
    const int64_t want = Count(CheckedMul({call->batch, call->query_len}));
    if (call->query_position) {
      return InvalidArgument("positions: give either query_position or positions, not both");
    }
    if (static_cast<int64_t>(call->positions.size()) != want) {
      return InvalidArgument("positions: " + std::to_string(call->positions.size()) +
                             " values; expected batch * query_len = " + CountText(want) +
                             " (one per query token, batch-first)");
    }
    for (int64_t p : call->positions) {
      if (p < 0 || p > kMaxPosition) {
        return InvalidArgument("positions: holds " + std::to_string(p) +
                               "; positions must lie in 0 to " + std::to_string(kMaxPosition));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status Validate(const ModelSpec& model, const AttendLimits& limits, AttendCall* call) {
  RETURN_IF_ERROR(CheckQuery(model, call));
  RETURN_IF_ERROR(CheckKept(call));
  RETURN_IF_ERROR(CheckKeyValuePair(model, call));
  RETURN_IF_ERROR(CheckKeyPadding(call));
  RETURN_IF_ERROR(CheckAttnMask(model, call));
  RETURN_IF_ERROR(CheckSize(model, limits, call));
  RETURN_IF_ERROR(CheckPositions(model, call));
  return PlanAnswer(model, limits, call);
}

Status ValidateCreateMemory(const ModelSpec& model, const AttendLimits& limits, AttendCall* call) {
  if (!call->key || !call->value) {
    return InvalidArgument(std::string(call->key ? "value" : "key") +
                           ": missing; CreateMemory takes key and value");
  }
  const TensorView& k = *call->key;
  if (!IsFloating(k.dtype)) {
    return InvalidArgument(std::string("key: dtype ") + DTypeName(k.dtype) +
                           " is not allowed; expected FLOAT32, FLOAT16 or BFLOAT16");
  }
  if (k.shape.size() != 2 && k.shape.size() != 3) {
    return InvalidArgument(
        "key: shape " + ShapeString(k.shape) + " has " + std::to_string(k.shape.size()) +
        " dims, expected [batch, key_len, kdim] in the layout, or unbatched [key_len, kdim]");
  }
  call->kv_use = AttendCall::Kv::kCreateMemory;
  call->batched = k.shape.size() == 3;
  call->batch = call->batched ? 0 : 1;  // 0: CheckKeyValue takes the key's.
  RETURN_IF_ERROR(CheckKeyValue(model, call));
  call->query = k;  // The dtype requests are batched by; no query rows.
  call->query_len = 0;
  RETURN_IF_ERROR(CheckKeyPadding(call));
  RETURN_IF_ERROR(CheckPositions(model, call));
  const int64_t tokens = Count(CheckedMul({call->batch, call->key_len}));
  call->tokens = tokens;
  call->attention_cost = 0;
  if (tokens > limits.max_tokens) {
    return InvalidArgument("request: " + CountText(tokens) +
                           " tokens (batch * key_len) is over the "
                           "per-request limit of " +
                           std::to_string(limits.max_tokens) +
                           " (server flag --max-request-tokens)");
  }
  call->output_shape.clear();
  call->weights_shape.clear();
  call->output_bytes = call->weights_bytes = 0;
  return Status::Ok();
}

}  // namespace attnserve
