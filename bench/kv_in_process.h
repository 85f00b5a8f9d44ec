#pragma once
// attnserve-kv-bench batched --in-process: the engine's own batched step, no transport and no
// queue: the same sessions (one cache each, prompts prefilled in chunks) stepped together through
// AttentionModel::ForwardBatch on the calling thread and `threads` - 1 helpers, as the server's
// idle workers help a batch. No LibTorch in this header (the engine's headers stay in its units).
#include <cstdint>
#include <string>
#include <vector>

namespace attnserve_bench {

struct InProcessResult {
  std::string error;  ///< Empty when it ran.
  double steps_per_s = 0;
  double call_p50_ms = 0;  ///< One batched step of every session.
  std::string kernels;     ///< ModelSpec::kernels.
};

/// This CPU's class for the engine's products ("AMX", "AVX512-BF16", "AVX-512 without BF16", "AVX2
/// only"): what the figures are for.
std::string CpuClass();

/// Loads `model_dir` (one model directory, as the server's --models holds it), keeps a session of
/// one sequence per prompt length in `prompts` (the prompt's tokens random, from a fixed seed),
/// then times `rounds` batched steps of one token for every session.
/// `device` ("cpu", "cuda") and `dtype` ("float32", "bfloat16", "float16") as the server's --device
/// and --dtype.
InProcessResult InProcessSteps(const std::string& model_dir, const std::vector<int>& prompts,
                               int rounds, int threads, const std::string& device = "cpu",
                               const std::string& dtype = "float32");

}  // namespace attnserve_bench
