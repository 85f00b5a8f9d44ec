#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "server/core/files.h"
#include "server/core/status.h"
#include "server/weights/model_weights.h"

namespace attnserve {

/// Parses a safetensors file held in memory (8-byte little-endian header length, JSON header,
/// data). Every header entry is checked against the data: dtype (F32, F16, BF16, F64; integer and
/// other types are refused, never cast), shape (element counts checked for overflow), offsets
/// inside the data, byte count equal to the shape's, and the tensors tiling the data section
/// exactly (no overlaps, no holes), as the format requires. The header must be strict JSON (no
/// duplicate keys). Values come back as float32. Errors are FAILED_PRECONDITION naming `where` and
/// the problem.
StatusOr<NamedTensors> ParseSafetensors(const std::string& bytes, const std::string& where);

/// The tensors of a safetensors file on disk that `select` accepts, reading only their bytes (a
/// checkpoint's file holds a whole model; one layer's attention is a few of its tensors). The
/// header is checked whole as ParseSafetensors checks it; FAILED_PRECONDITION naming the file.
StatusOr<NamedTensors> ReadSafetensorsTensors(
    const std::string& path, const std::function<bool(const std::string&)>& select);

/// Parses `text` as one JSON value, refusing what nlohmann::json would let pass silently: duplicate
/// object keys (it keeps the last) and nesting deeper than 64. Messages name `where`.
StatusOr<nlohmann::json> ParseStrictJson(const std::string& text, const std::string& where);

/// `v` as an integer from 0 to INT64_MAX (an unsigned value above it is not wrapped);
/// FAILED_PRECONDITION "FIELD is V; expected an integer from 0 to 9223372036854775807" otherwise.
StatusOr<int64_t> NonNegativeJsonInt(const nlohmann::json& v, const std::string& field);

}  // namespace attnserve
