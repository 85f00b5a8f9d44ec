// A model directory's config.json, and a decoder checkpoint's (weights/checkpoint.h) at the layer
// the first byte names.
#include <string>

#include "server/models/model_loader.h"
#include "server/weights/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  (void)attnserve::ParseModelConfig(text, "config.json");
  const int64_t layer = size > 0 ? static_cast<int64_t>(data[0] % 40) - 4 : 0;  // -4 to 35
  (void)attnserve::ParseCheckpointConfig(text, layer, "checkpoint/config.json");
  return 0;
}
