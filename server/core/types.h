#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/core/scheduling.h"

namespace attnserve {

/// Element type of tensor bytes on the wire and in models.
enum class DType { kFloat32, kFloat16, kBFloat16, kBool };

/// Bytes per element of `dtype`.
size_t DTypeSize(DType dtype);
/// Lower-case name, e.g. "float32".
const char* DTypeName(DType dtype);
/// True for the floating-point types.
inline bool IsFloating(DType dtype) { return dtype != DType::kBool; }

/// "[2, 7, 512]".
std::string ShapeString(const std::vector<int64_t>& shape);

/// A non-owning view of a tensor's bytes, which stay where they arrived (the request message): the
/// owner must outlive every use of the view.
struct TensorView {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
  /// The bytes lie in page-locked host memory (a HostStaging block): a device copies them
  /// straight from there, asynchronously, without staging them first.
  bool pinned = false;
};

/// Bytes inside a block that someone else owns (a staging block of pinned memory), kept alive by
/// `owner` for as long as this is held.
struct BlockBytes {
  std::shared_ptr<const void> owner;
  const char* data = nullptr;
  size_t size = 0;
  explicit operator bool() const { return owner != nullptr; }
};

/// Which attention weights a request wants back.
enum class WeightsMode { kNone, kAveraged, kPerHead };

/// Memory layout of query, key, value and output.
enum class TensorLayout { kBatchFirst, kSequenceFirst };

/// Rotary position embeddings (RoPE) as Llama-family decoders apply them: dimension j of each
/// head's first `rotary_dim` is paired with j + rotary_dim/2 (half-split, not interleaved) and
/// turned by position · inv_freq[j], inv_freq[j] = theta^(-2j/rotary_dim), in float32.
struct RotarySpec {
  double theta = 10000.0;
  int64_t rotary_dim = 0;  ///< Even, at most head_dim; the rest of each head is not rotated.
  /// "default", or "llama3": Llama 3's frequency scaling (the four fields below).
  std::string type = "default";
  double factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  int64_t original_max_position = 8192;
};

/// The attention of a decoder layer (Llama, Mistral, Qwen2, Qwen3): grouped key/value heads,
/// per-projection biases, RoPE, a sliding window, q/k RMSNorm, a softmax scale. Set on models
/// loaded from a Hugging Face checkpoint ("checkpoint" in config.json); absent on
/// nn.MultiheadAttention models, whose computation it never changes.
struct DecoderSpec {
  std::string family;  ///< The checkpoint's model_type: llama, mistral, qwen2, qwen3.
  int64_t layer = 0;   ///< Which layer of the checkpoint.
  int64_t num_kv_heads = 0;
  bool q_bias = false, k_bias = false, v_bias = false, o_bias = false;
  std::optional<RotarySpec> rotary;
  int64_t sliding_window = 0;  ///< Keys a query sees, itself included (0: all).
  bool qk_norm = false;        ///< RMSNorm over each head of q and k before RoPE (Qwen3).
  double rms_norm_eps = 1e-6;
  double scale = 0;  ///< Scores' scale (0: 1/sqrt(head_dim)).
};

/// What a model is: the nn.MultiheadAttention constructor arguments plus where and how it runs.
struct ModelSpec {
  std::string name;
  int64_t embed_dim = 0;
  int64_t num_heads = 0;
  int64_t kdim = 0;
  int64_t vdim = 0;
  bool bias = false;  ///< Any projection has a bias.
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  DType compute_dtype = DType::kFloat32;
  std::string device = "cpu";
  /// Which kernels compute it, e.g. "oneDNN bfloat16 on packed weights, float32 scores" (the
  /// start-up line, and attnserve_model_info's kernels label).
  std::string kernels;
  std::string weights_hash;  ///< "sha256:<hex>" over the canonical weights.
  std::string source;        ///< File the weights came from, or "built-in".
  int64_t version = 1;       ///< N for DIR/name/N/; 1 for an unversioned model directory.
  /// Priority levels and queue policies from its config.json ("dynamic_batching"); none: the
  /// server's (--priority-levels, --queue-policy).
  std::optional<PriorityOptions> priorities;

  /// A decoder layer's attention (grouped heads, RoPE...): none for nn.MultiheadAttention.
  std::optional<DecoderSpec> decoder;
  /// Each head's width: embed_dim / num_heads, or a decoder's own (Qwen3: 128 whatever embed_dim).
  int64_t head_size = 0;

  int64_t head_dim() const {
    return head_size > 0 ? head_size : num_heads > 0 ? embed_dim / num_heads : 0;
  }
  /// Key/value heads: num_heads, or fewer for grouped-query attention (1: multi-query).
  int64_t kv_heads() const {
    return decoder && decoder->num_kv_heads > 0 ? decoder->num_kv_heads : num_heads;
  }
  /// Widths of the projected queries (heads x head_dim) and of the projected keys and values.
  int64_t q_width() const { return num_heads * head_dim(); }
  int64_t kv_width() const { return kv_heads() * head_dim(); }
  /// Keys after bias_k and the zero key are appended.
  int64_t extra_keys() const { return (add_bias_kv ? 1 : 0) + (add_zero_attn ? 1 : 0); }
};

class KvCache;  // server/engine/attention_model.h

/// One attention request as the engine sees it. The views point into the wire message. The
/// fields under "filled by Validate" are derived; the engine relies on Validate having run.
struct AttendCall {
  TensorView query;
  std::optional<TensorView> key;  ///< Absent with value: self-attention.
  std::optional<TensorView> value;
  std::optional<TensorView> key_padding_mask;
  std::optional<TensorView> attn_mask;
  bool is_causal = false;
  WeightsMode weights = WeightsMode::kNone;
  TensorLayout layout = TensorLayout::kBatchFirst;

  /// Keys and values kept on the server between requests. kCreateMemory: project `key` and
  /// `value` into `kv` (nothing else is computed; no query). kMemory: cross-attention against
  /// `kv`'s keys (no key or value on the wire). kSession: the query's tokens are appended to `kv`
  /// (projected keys and values) and attend causally over everything it holds.
  enum class Kv { kNone, kCreateMemory, kMemory, kSession };
  Kv kv_use = Kv::kNone;
  std::shared_ptr<KvCache> kv;
  int64_t kv_batch = 0;     ///< The memory's or session's batch.
  int64_t kv_length = 0;    ///< kMemory: its keys; kSession: tokens held before this step.
  int64_t kv_capacity = 0;  ///< kSession: tokens per sequence its cache holds after this step.

  /// Rotary models (DecoderSpec::rotary): the position of the query's first token (token i is at
  /// query_position + i; a session step's default is the session's length), and of the first key
  /// token in cross-attention. `positions`, when not empty, gives every query token its own:
  /// batch * query_len values, batch-first (self-attention's keys are its queries).
  std::optional<int64_t> query_position;
  int64_t key_position = 0;
  std::vector<int64_t> positions;

  // Filled by Validate.
  bool batched = true;
  int64_t batch = 0;
  int64_t query_len = 0;
  int64_t key_len = 0;
  std::vector<int64_t> output_shape;   ///< The answer's output shape.
  std::vector<int64_t> weights_shape;  ///< The answer's attention weights shape (empty: none).
  int64_t output_bytes = 0;            ///< Bytes of the output in the query's dtype.
  int64_t weights_bytes = 0;           ///< Bytes of the attention weights (0: none requested).
  /// Rows this request brings to a batch's projections: batch * query_len, plus batch * key_len
  /// when key and value are on the wire (self-attention's keys are its queries; a memory's or
  /// session's are projected already). The --max-request-tokens count, and the batcher's.
  int64_t tokens = 0;
  /// Attention scores per head: batch * query_len * key_len (the batcher's attention budget).
  int64_t attention_cost = 0;

  /// Each batch element's rows are contiguous on the wire: batch-first layout, or no batch
  /// dimension at all (after Validate).
  bool batch_first() const { return layout == TensorLayout::kBatchFirst || !batched; }

  /// Keys are the query's own tokens: no key on the wire and no memory (a session step is).
  bool self_attention() const { return !key.has_value() && kv_use != Kv::kMemory; }
};

/// Floating-point operations of nn.MultiheadAttention's forward for a validated call: the four
/// projections, QK^T and PV (softmax and masks not counted). For achieved-FLOP/s metrics.
double ForwardFlops(const ModelSpec& model, const AttendCall& call);

/// Per-request limits, set by server flags.
struct AttendLimits {
  /// Most tokens one request may carry: batch * query_len, plus batch * key_len for
  /// cross-attention.
  int64_t max_tokens = 1 << 16;
  /// Most attention scores one request may need: batch * num_heads * query_len * key_len.
  int64_t max_attention_scores = int64_t{1} << 28;
  /// Most bytes of tensor data one answer may carry (output plus attention weights): the message
  /// size limit (server flag --max-message-bytes) less room for the answer's other fields.
  int64_t max_answer_bytes = (int64_t{64} << 20) - 1024;
  /// Most entries in one batched step (AttendRequest.steps; server flag --max-steps-per-call).
  int64_t max_steps = 1024;
};

}  // namespace attnserve
