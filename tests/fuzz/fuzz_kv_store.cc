// The keys and values kept between requests as a state machine: the input decodes into a sequence
// of operations on a KvStore and the LibTorch engine (tests/lib/kv_model_check.h: sessions, steps
// in flight and racing, memories, holds, releases, clock ticks with expiry, reloads, shutdown;
// sizes from the whole int64 range), checked after every operation against the reference model. A
// broken invariant aborts with what broke and the operations that led there. Half the inputs run
// on models whose sessions keep their keys and values in a pool (kept runs).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/lib/kv_model_check.h"

namespace {

std::string Run(const uint8_t* data, size_t size, std::string* log) {
  size_t at = 0;
  attnserve::testing::Choices choices([&](uint8_t* b) {
    if (at >= size) return false;
    *b = data[at++];
    return true;
  });
  attnserve::testing::KvCheckOptions options;
  options.max_ops = 256;
  // Answers are compared with their one-call forms by KvPropertyTest (ctest); here the engine runs
  // every step and memory query, and the checks are the store's.
  options.check_outputs = false;
  options.log = log;
  // Inputs of odd length run on pooled sessions with kept runs (the CUDA engine's layout), without
  // shifting what the corpus's bytes decode to.
  options.kept_runs = size % 2 == 1;
  return attnserve::testing::RunKvModelCheck(choices, options);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string failure = Run(data, size, nullptr);
  if (!failure.empty()) {
    std::string log;
    Run(data, size, &log);  // Again, with the operations that led there.
    std::fprintf(stderr, "kv model check failed: %s\noperations:\n%s", failure.c_str(),
                 log.c_str());
    std::abort();
  }
  return 0;
}
