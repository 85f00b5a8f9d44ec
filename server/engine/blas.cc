#include "server/engine/blas.h"

#include <dlfcn.h>

#include <mutex>

namespace attnserve {

BlasInfo ConfigureBlas() {
  static std::once_flag once;
  static BlasInfo info;
  std::call_once(once, [] {
    // Looked up, not linked: LibTorch picks the BLAS through Debian's alternatives.
    using Config = const char* (*)();
    using Parallel = int (*)();
    using SetThreads = void (*)(int);
    const auto config = reinterpret_cast<Config>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
    const auto parallel = reinterpret_cast<Parallel>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
    const auto set_threads =
        reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    if (config && parallel) {
      // 0: built without threading, and Debian's such build has no locking either.
      const int mode = parallel();
      if (set_threads && mode != 0) set_threads(1);
      info.description =
          std::string(config()) + (mode == 0   ? " (serial build: not thread-safe)"
                                   : mode == 1 ? " (pthread build, 1 thread per caller)"
                                               : " (OpenMP build, 1 thread per caller)");
      info.thread_safe = mode != 0;
      info.openblas = true;
      return;
    }
    using Version = const char* (*)();
    const auto blis = reinterpret_cast<Version>(dlsym(RTLD_DEFAULT, "bli_info_get_version_str"));
    // PyPI's LibTorch links MKL statically (thread-safe; its threads follow at::set_num_threads).
    using MklVersion = void (*)(char*, int);
    const auto mkl = reinterpret_cast<MklVersion>(dlsym(RTLD_DEFAULT, "MKL_Get_Version_String"));
    if (blis) {
      info.description = std::string("BLIS ") + blis();
    } else if (mkl) {
      char version[256] = {};
      mkl(version, sizeof(version) - 1);
      info.description = std::string(version) + " (in LibTorch)";
    } else {
      info.description = "an unidentified BLAS";
    }
  });
  return info;
}

}  // namespace attnserve
