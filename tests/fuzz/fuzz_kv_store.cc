// The keys and values kept between requests as a state machine: the input decodes into a sequence
// of operations on a KvStore and the LibTorch engine (tests/lib/kv_model_check.h: sessions, steps
// in flight and racing, memories, holds, releases, clock ticks with expiry, reloads, shutdown; sizes
// from the whole int64 range), checked after every operation against the reference model. A broken
// invariant aborts with what broke and the operations that led there.
#include <cstdio>
#include <cstdlib>

#include "tests/lib/kv_model_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  size_t at = 0;
  attnserve::testing::Choices choices([&](uint8_t* b) {
    if (at >= size) return false;
    *b = data[at++];
    return true;
  });
  attnserve::testing::KvCheckOptions options;
  options.max_ops = 256;
  const std::string failure = attnserve::testing::RunKvModelCheck(choices, options);
  if (!failure.empty()) {
    std::fprintf(stderr, "kv model check failed: %s\n", failure.c_str());
    std::abort();
  }
  return 0;
}
