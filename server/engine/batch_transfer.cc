#include "server/engine/batch_transfer.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <cstring>

#include "server/engine/torch_tensors.h"

namespace attnserve {

at::Tensor BatchTransfer::InputRows(const TensorView& v) const {
  const at::Tensor host = Wrap(v).view({-1, v.shape.back()});
  if (!device_.is_cuda()) {
    // Float32 rows for a bfloat16 model rounded by the AVX-512 kernel where there is one, as
    // LibTorch rounds them, in one pass from the wire's bytes.
    if (dtype_ == at::kBFloat16 && host.scalar_type() == at::kFloat && host.is_contiguous()) {
      at::Tensor rows = at::empty(host.sizes(), host.options().dtype(at::kBFloat16));
      if (small_attention::ToBfloat16(host.data_ptr<float>(), host.numel(),
                                      reinterpret_cast<uint16_t*>(rows.data_ptr()), kernels_))
        return rows;
    }
    return host.to(dtype_);
  }
  at::Tensor pinned = at::empty(host.sizes(), host.options().pinned_memory(true));
  pinned.copy_(host);
  return pinned.to(device_, dtype_, /*non_blocking=*/true);
}

PackedRows BatchTransfer::Pack(const std::vector<const AttendCall*>& calls, const PackingPlan& plan,
                               int64_t e, int64_t kdim, int64_t vdim, StageClock* clock) const {
  const auto opts = at::TensorOptions().device(device_).dtype(dtype_);
  PackedRows p;
  p.x = at::empty({plan.q_rows, e}, opts);
  if (plan.k_rows) {
    p.kx = at::empty({plan.k_rows, kdim}, opts);
    p.vx = at::empty({plan.k_rows, vdim}, opts);
  }
  const std::vector<at::Tensor> wire = WireTensors(calls, &p.held, clock);
  for (size_t i = 0, t = 0; i < calls.size(); ++i) {
    const AttendCall& c = *calls[i];
    p.x.narrow(0, plan.q_offset[i], c.batch * c.query_len).copy_(wire[t++].view({-1, e}));
    if (c.key) {
      const int64_t at = plan.k_offset[i], rows = c.batch * c.key_len;
      p.kx.narrow(0, at, rows).copy_(wire[t++].view({-1, kdim}));
      p.vx.narrow(0, at, rows).copy_(wire[t++].view({-1, vdim}));
    }
  }
  return p;
}

// The batch's query, key and value tensors in call order (query, then key and value where the
// call has them), shaped as on the wire, in the wire's dtype. On the CPU: the request bytes,
// uncopied. On CUDA: one device buffer filled by one host-to-device copy of a pinned staging
// block the bytes are gathered into (or, when every tensor already lies in pinned memory, one
// asynchronous copy each, no gathering); without room in the staging, a plain copy each.
std::vector<at::Tensor> BatchTransfer::WireTensors(const std::vector<const AttendCall*>& calls,
                                                   std::vector<std::shared_ptr<void>>* held,
                                                   StageClock* clock) const {
  std::vector<const TensorView*> views;
  for (const AttendCall* c : calls) {
    views.push_back(&c->query);
    if (c->key) {
      views.push_back(&*c->key);
      views.push_back(&*c->value);
    }
  }
  std::vector<at::Tensor> out;
  if (!device_.is_cuda()) {
    for (const TensorView* v : views) out.push_back(Wrap(*v));
    return out;
  }
  std::vector<int64_t> offset;
  int64_t total = 0;
  bool all_pinned = true;
  for (const TensorView* v : views) {
    offset.push_back(total);
    total += static_cast<int64_t>((v->nbytes + 63) / 64 * 64);  // Aligned for any dtype.
    all_pinned = all_pinned && v->pinned;
  }
  const at::Tensor device_bytes =
      at::empty({total}, at::TensorOptions().device(device_).dtype(at::kByte));
  const auto host = [](const void* p, int64_t n) {
    return at::from_blob(const_cast<void*>(p), {n}, at::TensorOptions().dtype(at::kByte));
  };
  char* block = nullptr;
  std::shared_ptr<void> staged;
  if (!all_pinned) staged = staging_->Allocate(static_cast<size_t>(total), &block);
  if (staged) {
    const auto gather_start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < views.size(); ++i)
      std::memcpy(block + offset[i], views[i]->data, views[i]->nbytes);
    clock->gather =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - gather_start).count();
    clock->Mark(kGathered);
    device_bytes.copy_(host(block, total), /*non_blocking=*/true);
    held->push_back(std::move(staged));
  } else {
    if (all_pinned) clock->gather = 0;
    clock->Mark(kGathered);
    for (size_t i = 0; i < views.size(); ++i) {
      const int64_t n = static_cast<int64_t>(views[i]->nbytes);
      device_bytes.narrow(0, offset[i], n).copy_(host(views[i]->data, n), all_pinned);
    }
  }
  clock->Mark(kCopiedIn);
  for (size_t i = 0; i < views.size(); ++i) {
    const int64_t n = static_cast<int64_t>(views[i]->nbytes);
    out.push_back(device_bytes.narrow(0, offset[i], n)
                      .view(ToScalarType(views[i]->dtype))
                      .view(views[i]->shape));
  }
  return out;
}

bool BatchTransfer::AnswersToStaging(const std::vector<const AttendCall*>& calls,
                                     const std::vector<Attended>& attended, const at::Tensor& y,
                                     const std::vector<int64_t>& q_off,
                                     const std::vector<AttendOutputs*>& outs,
                                     const StageClock& clock) const {
  const DType wire = calls[0]->query.dtype;  // One wire dtype per batch (the batcher's rule).
  for (const AttendCall* c : calls) {
    if (c->query.dtype != wire || c->weights != WeightsMode::kNone) return false;
  }
  const int64_t e = y.size(1), rows = y.size(0);
  const size_t row_bytes = static_cast<size_t>(e) * DTypeSize(wire);
  char* block = nullptr;
  std::shared_ptr<void> staged = staging_->Allocate(static_cast<size_t>(rows) * row_bytes, &block);
  if (!staged) return false;
  at::Tensor answers = y.to(ToScalarType(wire));
  for (size_t i = 0; i < calls.size(); ++i) {
    if (attended[i].dead.defined())
      answers.narrow(0, q_off[i], calls[i]->batch * calls[i]->query_len)
          .masked_fill_(attended[i].dead.to(device_), 0);  // Dead rows are found on the host.
  }
  at::from_blob(block, {rows, e}, at::TensorOptions().dtype(ToScalarType(wire)))
      .copy_(answers, /*non_blocking=*/true);
  clock.Mark(kCopiedOut);
  // The copy is on this worker's stream: wait for it (and only it) before the answers go out.
  c10::impl::VirtualGuardImpl(device_.type()).getStream(device_).synchronize();
  std::shared_ptr<const void> owner = std::move(staged);
  for (size_t i = 0; i < calls.size(); ++i) {
    const size_t rows_i = static_cast<size_t>(calls[i]->batch * calls[i]->query_len);
    outs[i]->output_block = {owner, block + static_cast<size_t>(q_off[i]) * row_bytes,
                             rows_i * row_bytes};
    outs[i]->attention_backend = attended[i].backend;
  }
  return true;
}

}  // namespace attnserve
