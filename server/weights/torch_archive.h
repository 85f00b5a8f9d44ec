#pragma once

#include <string>

#include "server/core/status.h"
#include "server/weights/model_weights.h"

namespace attnserve {

/// Reads a torch.save() archive of a state_dict held in memory, without LibTorch (whose unpickler
/// is not safe on hostile bytes): the zip container (stored entries, each CRC-checked, every offset
/// and size bounded by the file) and a restricted pickle machine that knows only what a state_dict
/// holds: OrderedDict, tensors rebuilt from typed storages, and plain values. Float, half, bfloat16
/// and double tensors become float32; integer, bool and complex tensors, unknown globals, storages
/// shorter or longer than their element count, and tensors reaching past their storage are refused.
/// Errors are FAILED_PRECONDITION naming `where` and the problem; never a crash, and never a read
/// outside `bytes`.
StatusOr<NamedTensors> ParseTorchArchive(const std::string& bytes, const std::string& where);

}  // namespace attnserve
