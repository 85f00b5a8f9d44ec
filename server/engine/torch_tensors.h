#pragma once
// Request bytes and model weights as LibTorch tensors, and the few conversions every engine piece
// shares. Included only by the engine's LibTorch translation units.

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>

#include <cstdint>
#include <vector>

#include "server/core/types.h"
#include "server/engine/onednn.h"
#include "server/weights/model_weights.h"

namespace attnserve {

/// The LibTorch dtype of a wire dtype (wire bools are bytes: any non-zero is true).
at::ScalarType ToScalarType(DType d);

/// A tensor over the request's bytes, without a copy. Wire bools become a real bool tensor.
at::Tensor Wrap(const TensorView& v);

/// A tensor's bytes, dims and strides as oneDNN reads them (float32 or bfloat16 tensors only).
onednn::View ViewOf(const at::Tensor& t);

/// A weight's values copied to `opts` (device and dtype).
at::Tensor FromHost(const HostTensor& h, const at::TensorOptions& opts);

/// Host int64s on `device` (CUDA: through pinned memory, without waiting).
at::Tensor LongsOnDevice(const std::vector<int64_t>& values, at::Device device);

/// A float mask (0 = attend, -inf = masked, else added) in `dtype` on `device`, from a bool or
/// float mask.
at::Tensor AdditiveMask(const at::Tensor& m, at::Device device, at::ScalarType dtype);

/// On a CUDA device, makes a stream from LibTorch's pool current for this thread: each compute
/// worker keeps its own stream, so workers overlap and a worker's synchronous copy back waits for
/// its own stream only. Device-generic (c10), so it compiles in CPU builds, where it does nothing.
class WorkerStream {
 public:
  explicit WorkerStream(at::Device device);

 private:
  c10::optional<c10::StreamGuard> guard_;
};

}  // namespace attnserve
