#include "server/engine/torch_kv.h"

#include <sys/mman.h>

#include <algorithm>
#include <utility>

#include "server/checked_math.h"

namespace attnserve {

at::Tensor KeptEmpty(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  if (!opts.device().is_cpu()) return at::empty(sizes, opts);
  std::optional<int64_t> n = static_cast<int64_t>(c10::elementSize(opts.dtype().toScalarType()));
  for (int64_t s : sizes) n = n ? CheckedMul({*n, s}) : n;
  if (!n || *n < 0) return at::empty(sizes, opts);  // Refused there, with LibTorch's message.
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(*n));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) return at::empty(sizes, opts);  // Let the heap try (and fail as it does).
  return at::from_blob(
      p, sizes, [bytes](void* q) { munmap(q, bytes); }, opts);
}

std::optional<int64_t> TorchKv::BytesFor(int64_t batch, int64_t capacity) const {
  if (batch < 0 || capacity < 0) return std::nullopt;
  return CheckedMul({batch, capacity, 2 * embed_dim_ + 1, elem_});  // keys, values, key padding
}

Status TorchKv::CopyFrom(const KvCache& source, int64_t length, int64_t capacity) {
  const auto* from = dynamic_cast<const TorchKv*>(&source);
  if (from == nullptr || from->embed_dim_ != embed_dim_ || length < 0 || capacity < length) {
    return Status(StatusCode::kInternal, "kept keys and values: a copy between unlike caches");
  }
  if (!from->k_.defined()) return Status::Ok();  // Nothing allocated: nothing to copy.
  try {
    const int64_t b = from->k_.size(0), h = from->k_.size(1), d = from->k_.size(3);
    at::Tensor k = KeptEmpty({b, h, capacity, d}, from->k_.options()),
               v = KeptEmpty({b, h, capacity, d}, from->v_.options()), kpm;
    const int64_t rows = std::min(length, from->k_.size(2));  // Rows a step computed.
    k.narrow(2, 0, rows).copy_(from->k_.narrow(2, 0, rows));
    v.narrow(2, 0, rows).copy_(from->v_.narrow(2, 0, rows));
    if (from->kpm_.defined()) {
      kpm = KeptEmpty({b, capacity}, from->kpm_.options()).zero_();
      kpm.narrow(1, 0, rows).copy_(from->kpm_.narrow(1, 0, rows));
    }
    k_ = std::move(k), v_ = std::move(v), kpm_ = std::move(kpm);
    return Status::Ok();
  } catch (const std::exception& e) {
    return Status(StatusCode::kResourceExhausted,
                  std::string("kept keys and values: the copy could not be made: ") + e.what());
  }
}

TorchKv::Window TorchKv::Memory() const {
  const int64_t b = k_.size(0), lk = k_.size(2);
  return {k_, v_, kpm_.defined() ? kpm_.view({b, 1, 1, lk}) : at::Tensor()};
}

TorchKv::Window TorchKv::Append(int64_t held, int64_t capacity, const at::Tensor& kh,
                                const at::Tensor& vh, const at::Tensor& kpm) {
  const int64_t b = kh.size(0), h = kh.size(1), t = kh.size(2), d = kh.size(3);
  const auto opts = kh.options();
  if (!k_.defined() || k_.size(2) < capacity) {
    // All of the grown cache first, then swapped in at once: a failed allocation leaves the
    // session's tensors as they were, never keys grown without their padding mask.
    at::Tensor nk = KeptEmpty({b, h, capacity, d}, opts), nv = KeptEmpty({b, h, capacity, d}, opts),
               nkpm;
    if (kpm_.defined()) nkpm = KeptEmpty({b, capacity}, opts).zero_();
    if (held > 0) {
      nk.narrow(2, 0, held).copy_(k_.narrow(2, 0, held));
      nv.narrow(2, 0, held).copy_(v_.narrow(2, 0, held));
      if (nkpm.defined()) nkpm.narrow(1, 0, held).copy_(kpm_.narrow(1, 0, held));
    }
    k_ = std::move(nk);
    v_ = std::move(nv);
    if (nkpm.defined()) kpm_ = std::move(nkpm);
  }
  k_.narrow(2, held, t).copy_(kh);
  v_.narrow(2, held, t).copy_(vh);
  if (kpm.defined() && !kpm_.defined()) kpm_ = KeptEmpty({b, k_.size(2)}, opts).zero_();
  if (kpm_.defined()) {
    if (kpm.defined()) {
      kpm_.narrow(1, held, t).copy_(kpm);
    } else {
      kpm_.narrow(1, held, t).zero_();
    }
  }
  const int64_t lk = held + t;
  return {k_.narrow(2, 0, lk), v_.narrow(2, 0, lk),
          kpm_.defined() ? kpm_.narrow(1, 0, lk).view({b, 1, 1, lk}) : at::Tensor()};
}

}  // namespace attnserve
