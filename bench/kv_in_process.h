#pragma once
// attnserve-kv-bench batched --in-process: the engine's own batched step, no transport and no
// queue: the same sessions (one cache each, prompts prefilled in chunks) stepped together through
// AttentionModel::ForwardBatch on the calling thread and `threads` - 1 helpers, as the server's
// idle workers help a batch. No LibTorch in this header (the engine's headers stay in its units).
#include <cstdint>
#include <string>
#include <vector>

namespace attnserve_bench {

/// This CPU's class for the engine's products ("AMX", "AVX512-BF16", "AVX-512 without BF16", "AVX2
/// only"): what the figures are for.
std::string CpuClass();

/// The engine's own batched step, kept between calls so that its rounds can alternate with the
/// server's (each ratio of neighbours in time, on a host whose speed drifts).
class InProcessStepper {
 public:
  /// Loads `model_dir` (one model directory, as the server's --models holds it), keeps a session
  /// of one sequence per prompt length in `prompts` (the prompt's tokens random, from a fixed
  /// seed), and makes the queries of `rounds` steps. `device` ("cpu", "cuda") and `dtype`
  /// ("float32", "bfloat16", "float16") as the server's --device and --dtype. error() says why
  /// when it could not.
  InProcessStepper(const std::string& model_dir, const std::vector<int>& prompts, int rounds,
                   int threads, const std::string& device = "cpu",
                   const std::string& dtype = "float32");
  ~InProcessStepper();
  InProcessStepper(const InProcessStepper&) = delete;
  InProcessStepper& operator=(const InProcessStepper&) = delete;
  const std::string& error() const;
  const std::string& kernels() const;  ///< ModelSpec::kernels.
  /// The next `n` rounds, each one batched step of one token for every session: steps a second
  /// over them (0 on an error), each round's milliseconds appended to `ms`.
  double Rounds(int n, std::vector<double>* ms);

 private:
  struct State;
  State* state_;
};

}  // namespace attnserve_bench
