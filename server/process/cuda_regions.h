#pragma once

#include <string>

#include "server/shm/shared_memory.h"

namespace attnserve {

/// How a server computing on `device` opens CUDA shared-memory regions (the Open Inference
/// Protocol's CudaSharedMemoryRegister): another process's allocation opened through its IPC
/// handle, read and written by copies. Null on the CPU, where registering one is refused.
CudaRegionOpener CudaRegions(const std::string& device);

}  // namespace attnserve
