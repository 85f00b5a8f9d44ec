#include "server/engine/torch_tensors.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <limits>

namespace attnserve {

at::Tensor LongsOnDevice(const std::vector<int64_t>& values, at::Device device) {
  const at::Tensor host = at::from_blob(const_cast<int64_t*>(values.data()),
                                        {static_cast<int64_t>(values.size())}, at::kLong);
  if (!device.is_cuda()) return host.clone();
  at::Tensor pinned = at::empty(host.sizes(), host.options().pinned_memory(true));
  pinned.copy_(host);
  return pinned.to(device, at::kLong, /*non_blocking=*/true);
}

at::ScalarType ToScalarType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kBool:
      return at::kByte;
  }
  return at::kFloat;
}

at::Tensor Wrap(const TensorView& v) {
  at::Tensor t = at::from_blob(const_cast<void*>(v.data), v.shape,
                               at::TensorOptions().dtype(ToScalarType(v.dtype)));
  return v.dtype == DType::kBool ? t.ne(0) : t;
}

onednn::View ViewOf(const at::Tensor& t) {
  return {t.data_ptr(),
          t.scalar_type() == at::kBFloat16 ? onednn::Type::kBFloat16 : onednn::Type::kFloat32,
          t.sizes().vec(), t.strides().vec()};
}

at::Tensor FromHost(const HostTensor& h, const at::TensorOptions& opts) {
  return at::from_blob(const_cast<float*>(h.values.data()), h.shape, at::kFloat)
      .to(opts, /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor AdditiveMask(const at::Tensor& m, at::Device device, at::ScalarType dtype) {
  const at::Tensor d = m.to(device);
  if (d.scalar_type() == at::kBool) {
    return at::zeros(d.sizes(), d.options().dtype(dtype))
        .masked_fill_(d, -std::numeric_limits<double>::infinity());
  }
  return d.to(dtype);
}

WorkerStream::WorkerStream(at::Device device) {
  if (!device.is_cuda()) return;
  thread_local c10::optional<c10::Stream> stream;
  if (!stream || stream->device() != device) {
    stream = c10::impl::getDeviceGuardImpl(device.type())->getStreamFromGlobalPool(device);
  }
  guard_.emplace(*stream);
}

}  // namespace attnserve
