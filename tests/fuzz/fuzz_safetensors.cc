// A safetensors weights file: parse, then map to nn.MultiheadAttention weights.
#include <string>

#include "server/weights/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto tensors = attnserve::ParseSafetensors(bytes, "fuzz.safetensors");
  if (tensors.ok()) {
    attnserve::ModelConfig config;
    config.num_heads = 2;
    (void)attnserve::CanonicalizeWeights(tensors.value(), config, "fuzz.safetensors");
  }
  return 0;
}
