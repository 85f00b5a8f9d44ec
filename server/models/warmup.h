#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"
#include "server/engine/attention_model.h"

namespace attnserve {

/// What a model's batches will look like, from the batcher's budgets (server flags): the shapes a
/// warm-up runs. Defaults are the CPU's batcher defaults.
struct WarmupShapes {
  /// Off: models serve cold (the first requests of each shape make kernels and primitives).
  bool enabled = true;
  /// --max-batch-tokens: the rows a packed batch of small requests reaches.
  int64_t batch_tokens = 1024;
  /// --max-shared-request-tokens: requests over it are computed alone.
  int64_t shared_request_tokens = 256;
  /// --max-request-tokens: no warm-up request is larger.
  int64_t max_request_tokens = int64_t{1} << 16;
  /// Rows of the longest lone request warmed (kept short: the CPU pays for every row).
  int64_t lone_tokens = 512;
  /// --max-attention-scores: no warm-up request has more (heads x rows x rows), so none is one the
  /// server would refuse (a GPU's device-sized budgets ask for requests over it).
  int64_t max_attention_scores = AttendLimits().max_attention_scores;

  /// No warm-up at all.
  static WarmupShapes Off() {
    WarmupShapes s;
    s.enabled = false;
    return s;
  }
};

/// One batch a warm-up computes: its requests' shapes, for tests and the start-up line.
struct WarmupBatch {
  DType wire = DType::kFloat32;
  std::vector<int64_t> query_lens;  ///< Self-attention rows of each request ([1, L, E]).
  int64_t cross_key_len = 0;        ///< > 0: one more request, cross-attention over this many keys.
  bool causal = false;
  bool weights = false;  ///< The requests ask for averaged attention weights.
};

/// The batches that warm `spec` for `shapes`: on every wire dtype the model is likely to be sent
/// (float32, and its compute dtype when narrower), a one-row request (a decoding step), lone
/// requests up to the shared size and lone_tokens, a causal one, one asking for attention
/// weights, and packed batches of small self- and cross-attention requests up to the batch
/// budget (a model whose kdim or vdim is not embed_dim gets cross-attention requests of the same
/// lengths). Pure: no LibTorch.
std::vector<WarmupBatch> PlanWarmup(const ModelSpec& spec, const WarmupShapes& shapes);

/// How a warm-up's batch is computed: one Status per call. The server's computes them as requests
/// (Batcher::ComputeAndWait), on the threads that will serve the model; null: ForwardBatch on the
/// calling thread.
using WarmRunner = std::function<std::vector<Status>(const std::shared_ptr<const AttentionModel>&,
                                                     const std::vector<const AttendCall*>&,
                                                     const std::vector<AttendOutputs*>&)>;

/// Computes every batch of PlanWarmup(model->spec(), shapes) on fixed-seed random inputs through
/// `run`, so that the kernels, primitives, library handles and per-thread buffers its requests
/// need exist before the first one arrives. Returns the first failure (the model is then not fit
/// to serve).
Status WarmModel(const std::shared_ptr<const AttentionModel>& model, const WarmupShapes& shapes,
                 const WarmRunner& run = nullptr);

}  // namespace attnserve
