#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"
#include "server/engine/host_staging.h"
#include "server/engine/parallel.h"
#include "server/weights/model_weights.h"

namespace attnserve {

/// Where a batch's time went on a GPU, in seconds (-1: not measured, as on the CPU): gathering the
/// wire bytes into one pinned staging block on the host (0 when they already lay in pinned memory),
/// the copy to the device, the compute (projections, attention, conversions), the copy of the
/// answers back. The device stages are CUDA event intervals on the worker's stream, so a stage
/// also holds the time the device waited for the host to queue its work.
struct BatchStages {
  double gather = -1, copy_in = -1, compute = -1, copy_out = -1;
};

/// Where the engine writes one request's results: buffers owned by the caller (the response
/// message), resized and filled by Forward, so the result becomes response bytes in one copy. Their
/// shapes are the validated call's (AttendCall::output_shape, weights_shape).
struct AttendOutputs {
  std::string* output = nullptr;   ///< Required.
  std::string* weights = nullptr;  ///< Required when weights were requested.
  /// Set by the engine instead of writing *output when the answer lies in a staging block of its
  /// own (CUDA: the batch's answers copied back from the device into one pinned block); the front
  /// end sends it from there.
  BlockBytes output_block;
  /// The attention kernel that ran: "math", or on LibTorch 2.x the fused SDPA backend chosen
  /// ("flash", "efficient", "cudnn", ...). Set by Forward.
  const char* attention_backend = "math";
  /// GPU time of the batch this call ran in, from CUDA events on the worker's stream; -1 when not
  /// measured (CPU). Set by ForwardBatch.
  double device_seconds = -1;
  /// The stages of that batch's time (CUDA); set by ForwardBatch.
  BatchStages stages;
};

/// Where kept keys and values that no one entry counts as its own count their bytes (the store's
/// budget): blocks a session shared with its forks and then let go of, while a fork still reads
/// them. Thread-safe.
class KvLedger {
 public:
  virtual ~KvLedger() = default;
  virtual void Charge(int64_t bytes) = 0;  ///< Negative: given back.
};

/// Keys and values an engine keeps on its device between requests: a memory's projected keys and
/// values, or a decoding session's so far (AttendCall::kv). Made by AttentionModel::NewKvCache;
/// only that model reads or writes it, one request at a time for a session. A session's tokens may
/// lie partly in blocks it shares with the sessions forked from it or that it was forked from
/// (ShareFrom): those are its shared tokens, counted once whoever holds them.
class KvCache {
 public:
  virtual ~KvCache() = default;
  /// Device bytes the cache allocates for `batch` sequences of `capacity` tokens; nullopt when a
  /// size is negative or the count overflows int64.
  virtual std::optional<int64_t> BytesFor(int64_t batch, int64_t capacity) const = 0;
  /// Tokens per sequence its allocation holds now (0: nothing allocated yet). Read it only while no
  /// request computes into the cache: a session step grows it to AttendCall::kv_capacity, whether
  /// the step then succeeds or not.
  virtual int64_t AllocatedTokens() const = 0;
  /// Of AllocatedTokens, those held in shared blocks (the store does not count them for this
  /// entry: a block shared is counted once, by the entry whose own allocation it is, or by itself
  /// through the ledger once no entry owns it).
  virtual int64_t SharedTokens() const { return 0; }
  /// What a session step appending after `held` tokens can keep (read while no request computes
  /// into the cache): the tokens it will share (`shared`), the tokens of its own allocation it can
  /// write on (`own`: 0 when the step starts a new one), and whether that allocation, replaced by
  /// a larger one, stays alive for forks that read it (`retained`). The step is then given a
  /// capacity of shared + own' tokens and allocates own' - own more when own' > own.
  struct Plan {
    int64_t shared = 0, own = 0;
    bool retained = false;
  };
  virtual Plan PlanAppend(int64_t held) const { return Plan{0, AllocatedTokens(), false}; }
  /// Makes this empty cache a fork of `source`'s first `length` tokens: it shares them, nothing is
  /// copied, and `source` will not overwrite them (a later step of its own that would writes
  /// elsewhere). `source` is a cache of the same model that no request computes into meanwhile.
  /// FAILED_PRECONDITION where the engine cannot.
  virtual Status ShareFrom(KvCache& source, int64_t length) {
    (void)source, (void)length;
    return Status(StatusCode::kFailedPrecondition,
                  "this engine does not fork kept keys and values");
  }
  /// The store's budget, for blocks that outlive their owner's count.
  void set_ledger(std::shared_ptr<KvLedger> ledger) { ledger_ = std::move(ledger); }

 protected:
  std::shared_ptr<KvLedger> ledger_;
};

/// One loaded multi-head attention model. Thread-safe: Forward may run on many threads at once.
class AttentionModel {
 public:
  virtual ~AttentionModel() = default;
  /// What the model is.
  virtual const ModelSpec& spec() const = 0;
  /// Computes nn.MultiheadAttention's forward for a call that passed Validate. Output dtype is the
  /// query's. Never throws: engine failures come back as INTERNAL or RESOURCE_EXHAUSTED.
  virtual Status Forward(const AttendCall& call, AttendOutputs* out) const = 0;
  /// An empty cache for a memory or session of this model; nullptr when the engine keeps none.
  virtual std::shared_ptr<KvCache> NewKvCache() const { return nullptr; }
  /// Computes several calls together (same query dtype and weights mode), one Status each, its
  /// pieces on `parallel`'s threads (the cores idle at the moment; answers do not depend on how
  /// many). The default runs them one by one on the caller; engines override it to share work
  /// across the batch and split it across cores.
  virtual std::vector<Status> ForwardBatch(const std::vector<const AttendCall*>& calls,
                                           const std::vector<AttendOutputs*>& outs,
                                           const Parallel& parallel) const {
    (void)parallel;
    std::vector<Status> statuses;
    for (size_t i = 0; i < calls.size(); ++i) statuses.push_back(Forward(*calls[i], outs[i]));
    return statuses;
  }
  /// The same on the calling thread alone.
  std::vector<Status> ForwardBatch(const std::vector<const AttendCall*>& calls,
                                   const std::vector<AttendOutputs*>& outs) const {
    return ForwardBatch(calls, outs, SerialParallel());
  }
};

/// Device and precision for the LibTorch engine.
struct EngineOptions {
  std::string device = "cpu";  ///< "cpu", "cuda" or "cuda:N".
  DType compute_dtype = DType::kFloat32;
  /// CUDA float32 only: let matmuls use TF32 tensor cores (faster, ~1e-3 relative error).
  bool allow_tf32 = false;
  /// Small requests batched together attend in one varlen kernel launch over their packed rows, no
  /// padding (CUDA with LibTorch >= 2.11: flash attention's varlen form for float16/bfloat16, else
  /// the memory-efficient kernel's), instead of one fused attention per request. kEmulate runs the
  /// same packing on any device with per-sequence attention: how the CPU tests check it.
  enum class Varlen { kOff, kAuto, kEmulate };
  Varlen varlen = Varlen::kAuto;
  /// Calls of up to this many rows per projection (batch * max(query_len, key_len)) share a
  /// batch's packed projection GEMMs and varlen attention; larger ones are computed alone. 0: the
  /// device's default: 128 on the CPU (larger requests fill a GEMM there by themselves, and
  /// packing would only add copies: bench/RESULTS.md), every call on CUDA (one GEMM per
  /// projection and one varlen launch per group for the whole batch, long requests included:
  /// docs/hardware.md).
  int64_t pack_rows = 0;
  /// With idle cores (ForwardBatch's Parallel), the least work (floating-point operations) a piece
  /// of one batch must hold to go to another core: ~40 µs on one core here, several times what
  /// waking a worker for it costs. Tests set 0 to cut every call as finely as the cores allow.
  double min_piece_flops = 4e6;
  /// CPU bfloat16: multiply bfloat16 matrices in float32 (operands widened, products rounded back)
  /// even where LibTorch's own bfloat16 products accumulate in float32. The engine does so by
  /// itself where they do not (LibTorch 1.13 on CPUs without AVX-512: checked once at start); tests
  /// force it.
  bool force_float32_bfloat16_products = false;
  /// CUDA: the pinned host memory a batch's copies pass through (its inputs gathered into one
  /// block and copied in one copy, its answers copied back into one block and sent from there).
  /// Shared by every model of the server; null: the model makes one of kDefaultStagingBytes.
  std::shared_ptr<HostStaging> staging;
  static constexpr int64_t kDefaultStagingBytes = int64_t{1} << 30;
  /// Where varlen kernels attend over sessions' kept keys and values in place (CUDA with LibTorch
  /// >= 2.11, and every device under Varlen::kEmulate), those are kept in pools of chunks, a new
  /// chunk this many bytes (or one session's block, when larger). 0: the device's default (CUDA
  /// 1 GiB, CPU 16 MiB). A step of many sessions attends in one launch per chunk its sessions lie
  /// in (docs/kv.md).
  int64_t kv_pool_chunk_bytes = 0;
  /// The most bytes a model's pool holds in chunks (0: no bound): past it sessions' blocks are
  /// allocated on their own, so that however slots come and go (fragmentation) the pool never
  /// holds more than this beside what the kept keys and values' budget counts. The server sets
  /// it, and the chunk size at most, to --kv-budget-bytes.
  int64_t kv_pool_max_bytes = 0;
};

/// Builds a LibTorch model from host weights. FAILED_PRECONDITION when the device is unusable
/// (e.g. "cuda" on a build or machine without CUDA).
StatusOr<std::unique_ptr<AttentionModel>> CreateTorchModel(const ModelWeights& weights,
                                                           const EngineOptions& options);

/// "LibTorch 1.13.0 (CPU)" or "LibTorch 2.5.1 (CUDA 12.4)", for the start-up log.
std::string EngineDescription();

/// The CPU's class for bfloat16 products: "AMX", "AVX512-BF16", "AVX-512 without BF16" or "AVX2
/// only".
std::string EngineCpuClass();
/// oneDNN's version and the ISA of its kernels here, e.g. "oneDNN 2.6.3, avx512_core_bf16".
std::string EngineOnednnDescription();

/// True when the LibTorch in use has fused scaled-dot-product attention (2.x): a forward that asks
/// for no attention weights runs in it (AttendOutputs::attention_backend names the kernel), except
/// CPU bfloat16 models, whose attention runs through oneDNN with float32 scores (faster there).
bool EngineHasFusedAttention();

}  // namespace attnserve
