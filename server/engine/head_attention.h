#pragma once
// Attention over heads: q [B, H, Lq, D] against keys and values [B, H, Lk, D], with
// nn.MultiheadAttention's masks, appended keys (bias_k/bias_v, the zero key) and attention weights,
// computed block by block over the queries on the cores idle at the moment. Three paths: LibTorch's
// fused kernel (2.x), the math path (scores, softmax, values, with float32 scores on the CPU), and
// the math path widened to float32 (bfloat16 where the CPU's bfloat16 products add in bfloat16).
// Included only by the engine's LibTorch translation units.

#include <ATen/ATen.h>

#include <vector>

#include "server/core/types.h"
#include "server/engine/attention_model.h"
#include "server/engine/products.h"
#include "server/engine/small_attention.h"

namespace attnserve {

/// One call's attention result before the output projection.
struct Attended {
  at::Tensor merged;  ///< [B*Lq, E] in the wire's row order (undefined when written to a dst)
  at::Tensor dead;    ///< [B*Lq, 1] bool: query masked in every head (undefined: none)
  const char* backend = "math";
};

/// What attention needs of its model.
struct HeadAttentionOptions {
  int64_t num_heads = 1, head_dim = 1;
  /// Key/value heads (0: num_heads). Fewer: grouped-query attention, query head h reading
  /// key/value head h / (num_heads / num_kv_heads).
  int64_t num_kv_heads = 0;
  double scale = 0;    ///< The scores' scale (0: 1/sqrt(head_dim)).
  int64_t window = 0;  ///< Sliding window: a query sees the `window` keys up to its own (0: all).
  at::Tensor bias_k, bias_v;  ///< [E] in the compute dtype; undefined without add_bias_kv.
  bool add_zero_attn = false;
  at::Device device = at::kCPU;
  /// Scores' dtype: float32 on the CPU whatever the compute dtype (scores, masks and softmax from
  /// the products' float32 accumulators); the compute dtype on CUDA (its fused kernels take masks
  /// in it).
  at::ScalarType score_dtype = at::kFloat;
  bool widen = false;           ///< Attention in float32 for bfloat16 inputs.
  bool fused = false;           ///< LibTorch's fused kernel, when no weights are asked for.
  bool onednn_float32 = false;  ///< float32 products through oneDNN.
  /// Float32 products of a few query rows a head (a grouped head's decoding step) through
  /// small_attention's kernels, which read the keys and values once from their rows.
  bool small_products = false;
  /// Bfloat16 products on operands copied dense, head after head (onednn::WantsDenseOperands):
  /// the queries of each block, the keys and values once a call (in one piece), the values'
  /// product into rows of its own. Not for one query row a head (a decoding step of an
  /// ungrouped model: those products read every kept key once, and a copy would read them twice).
  bool dense_products = false;
  /// The most bytes of keys and values one call copies dense (a session's whole history at every
  /// step): past it the products take them as they lie, so that in-flight steps of long sessions
  /// never hold a second copy of what a budget counts (64 MiB: 16k tokens of 8 bfloat16 key/value
  /// heads of 128).
  int64_t dense_max_bytes = int64_t{64} << 20;
  /// The softmax of float32 scores on small_attention's AVX-512 kernel where the CPU has it
  /// (LibTorch 1.13's exp is its AVX2 one), bfloat16 probabilities written by it straight for
  /// bfloat16 values.
  bool own_softmax = false;
  /// The instruction set small_attention's kernels run at (small products and the own softmax;
  /// this CPU's best). The engine passes oneDNN's (ONEDNN_MAX_CPU_ISA caps both alike).
  small_attention::Isa kernels = small_attention::Best();
};

/// Attention over heads for one model. Thread-safe. With grouped key/value heads the queries of
/// one group are laid out as the rows of one matrix ([B, KVH, Lq*G, D], a copy of the queries),
/// so each key/value head is read once for its G query heads, never copied G times.
class HeadAttention {
 public:
  /// Most attention scores one block of queries may hold at once (B·H·rows·S): a long request
  /// needs this much working memory (scores, their softmax and the block's mask: ~3 x 8 MiB in
  /// float32) instead of three [B, H, Lq, S] matrices (1.5 GiB for one [1, 4096, 512] request with
  /// 8 heads).
  static constexpr int64_t kBlockScores = int64_t{2} << 20;

  /// `products` must outlive it.
  HeadAttention(HeadAttentionOptions options, const Products& products)
      : o_(std::move(options)), products_(products) {}

  /// Attention of `call` over heads: qh [B, H, Lq, D]; keys and values [B, KVH, Lk, D] (Lk =
  /// call.key_len) as consecutive pieces along the sequence (a forked session's shared blocks,
  /// then its own; else one piece); kpm additive and broadcastable to [B, 1, 1, Lk] (or undefined).
  /// A causal query i may attend key j when j <= i + causal_offset (and, with a window, only when
  /// j > i + causal_offset - window, causal or not). The merged heads go to `dst`
  /// ([B*Lq, E] rows in the wire's order) when it is defined, else to Attended::merged; requested
  /// attention weights straight into `out`'s weights buffer, in the query's dtype.
  Attended Attend(const AttendCall& call, const at::Tensor& qh, std::vector<at::Tensor> ks,
                  std::vector<at::Tensor> vs, const at::Tensor& kpm, int64_t causal_offset,
                  const at::Tensor& dst, AttendOutputs* out, const Parallel& parallel) const;

  /// Whether the fused kernel runs (never when weights are asked for).
  bool Fused(bool want_weights) const { return o_.fused && !want_weights; }

  // ---- the pieces (public for their tests) -----------------------------------------------------
  /// One block of queries' mask, additive in the scores' dtype and broadcastable to [B, H, n, S]
  /// (undefined: nothing masked), and its rows whose every key is masked.
  struct BlockMask {
    at::Tensor mask;
    at::Tensor dead;  ///< [B, H, n, 1] bool (when mask is defined)
    bool any_dead = false;
  };
  /// The mask of queries [q0, q0 + n) over `lk` keys then `extra` appended ones (never masked):
  /// `attn_mask` ([Lq, Lk] or [B, H, Lq, Lk], bool or float; undefined: none), `kpm`, and when
  /// `causal` the causal mask (query i sees key j <= i + causal_offset). `like`: the query's
  /// tensor options.
  BlockMask MaskFor(const at::Tensor& attn_mask, const at::Tensor& kpm, bool causal,
                    int64_t causal_offset, int64_t q0, int64_t n, int64_t lk, int64_t extra,
                    int64_t b, const at::TensorOptions& like) const;
  /// The math path's probabilities [B, H, n, S] for queries qc [B, H, n, D] over keys in pieces:
  /// scale·q·kᵀ plus the mask, softmax, rows masked for every key zero. In the scores' dtype, or
  /// rounded to `dtype` (bfloat16 for the values' product) when given.
  at::Tensor Probabilities(const at::Tensor& qc, const std::vector<at::Tensor>& ks,
                           const BlockMask& m,
                           at::ScalarType dtype = at::ScalarType::Undefined) const;
  /// heads [B, H, n, D] = p · values (in pieces along the keys), in the values' dtype.
  void TimesValues(const at::Tensor& p, const std::vector<at::Tensor>& vs,
                   const at::Tensor& heads) const;
  /// The fused path for one block: LibTorch's kernel, masked rows zero; `backend` names it.
  at::Tensor AttendFused(const at::Tensor& qc, const at::Tensor& k, const at::Tensor& v,
                         const BlockMask& m, bool causal, const char** backend) const;

 private:
  struct Job;
  // bias_k/bias_v, then the zero key/value, appended along the key sequence (as pieces of their
  // own when there are several).
  void AppendExtraKeys(int64_t b, const at::TensorOptions& like, std::vector<at::Tensor>* ks,
                       std::vector<at::Tensor>* vs) const;
  void RunBlock(const Job& job, int64_t block) const;
  at::ScalarType ValuesDtype(const Job& job) const;
  // The grouped layout of a block's mask and dead rows: [B', H', n, S] -> [B', 1 or KVH, n*G, S]
  // (the rows of query i are i*G ... i*G + G-1, one per head of the group).
  BlockMask Grouped(const BlockMask& m, int64_t b, int64_t n) const;
  int64_t kv_heads() const { return o_.num_kv_heads > 0 ? o_.num_kv_heads : o_.num_heads; }
  int64_t group() const { return o_.num_heads / kv_heads(); }
  // pp [H, n, S'] = scale · q [H, n, D] · kt [H, D, S'] (+ mask, broadcastable to pp).
  void ScoresInto(at::Tensor pp, const at::Tensor& q, const at::Tensor& kt, const at::Tensor& mask,
                  double scale) const;
  // Whether products on `t`'s dtype go to oneDNN: on the CPU in bfloat16, and in float32 where
  // the model asks for it (HeadAttentionOptions::onednn_float32); oneDNN takes the strided heads as
  // they lie.
  bool OnednnAttends(const at::Tensor& t) const;
  // small_attention's kernels for pp [H, n, S'] = scale · q [H, n, D] · kt [H, D, S'] and for
  // out [H, n, D] (+)= p [H, n, S'] · v [H, S', D], where they take the operands (float32 rows
  // laid out as they read them, HeadAttentionOptions::small_products); false: nothing done.
  bool SmallScores(const at::Tensor& pp, const at::Tensor& q, const at::Tensor& kt,
                   double scale) const;
  bool SmallTimesValues(const at::Tensor& p, const at::Tensor& v, const at::Tensor& out,
                        bool accumulate) const;
  // And its softmax over p's last dim (float32, rows contiguous): in place, or rounded to
  // bfloat16 into a tensor of its own when `dtype` is that. Undefined: not done.
  at::Tensor SmallSoftmax(const at::Tensor& p, at::ScalarType dtype) const;

  const HeadAttentionOptions o_;
  const Products& products_;
};

}  // namespace attnserve
