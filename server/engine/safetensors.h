#pragma once

#include <string>

#include "server/engine/model_weights.h"
#include "server/status.h"

namespace attnserve {

/// Parses a safetensors file held in memory (8-byte little-endian header length, JSON header,
/// data). Every header entry is checked against the data: dtype (F32, F16, BF16, F64), shape,
/// offsets inside the data and byte count equal to the shape's. Values come back as float32.
/// Errors are FAILED_PRECONDITION naming `where` and the problem.
StatusOr<NamedTensors> ParseSafetensors(const std::string& bytes, const std::string& where);

/// Reads a whole file; FAILED_PRECONDITION naming the file when it cannot.
StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace attnserve
