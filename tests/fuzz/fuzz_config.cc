// A model directory's config.json.
#include <string>

#include "server/models/model_loader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)attnserve::ParseModelConfig(std::string(reinterpret_cast<const char*>(data), size),
                                    "config.json");
  return 0;
}
