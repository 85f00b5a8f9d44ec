#pragma once

#include <string>

namespace attnserve {

/// The BLAS that LibTorch's CPU matrix products run on in this process.
struct BlasInfo {
  std::string description;  ///< e.g. "OpenBLAS 0.3.21 ... (pthread build, 1 thread per caller)".
  /// False for a build that corrupts results when several threads call it at once (OpenBLAS built
  /// without threading or locking: Debian's libopenblas0-serial).
  bool thread_safe = true;
  bool openblas = false;  ///< OpenBLAS (Debian's LibTorch; PyPI's links MKL).
};

/// Describes the loaded BLAS and, for OpenBLAS, sets one BLAS thread per calling thread: the server
/// already runs one compute thread per core, so BLAS threads would only oversubscribe the cores.
/// Idempotent and thread-safe; CreateTorchModel calls it.
BlasInfo ConfigureBlas();

}  // namespace attnserve
