#pragma once
// A batch's bytes between the wire and the compute device: its request tensors in the compute
// dtype, packed into one matrix per projection as its packing plan says (on CUDA gathered into a
// pinned staging block and copied in one copy), and its answers copied back into one staging block
// they are sent from. The device's marks time the stages. One of the engine's LibTorch units.

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "server/core/packing_plan.h"
#include "server/core/types.h"
#include "server/engine/attention_model.h"
#include "server/engine/device_support.h"
#include "server/engine/head_attention.h"
#include "server/engine/host_staging.h"
#include "server/engine/small_attention.h"

namespace attnserve {

/// Points of a batch's work on the device that DeviceTimer marks (BatchStages: the intervals).
enum BatchMark { kGathered = 0, kCopiedIn = 1, kComputed = 2, kCopiedOut = 3 };

/// Where a packed batch's time goes: the device's marks, and the host's gather into staging.
struct StageClock {
  DeviceTimer* device = nullptr;
  double gather = -1;
  void Mark(BatchMark m) const {
    if (device) device->Mark(m);
  }
};

/// A batch's wire rows in the compute dtype, packed as its plan says: every query row in x, the
/// key and value rows that came on the wire in kx and vx; `held` keeps the host block they were
/// staged in until its copy to the device is done.
struct PackedRows {
  at::Tensor x, kx, vx;
  std::vector<std::shared_ptr<void>> held;
};

/// The transfers of one model's batches. Thread-safe.
class BatchTransfer {
 public:
  /// `staging`: pinned host memory for CUDA's copies (null on the CPU). `kernels`: the instruction
  /// set of the float32-to-bfloat16 rounding of the CPU's inputs.
  BatchTransfer(at::Device device, at::ScalarType dtype, small_attention::Isa kernels,
                std::shared_ptr<HostStaging> staging)
      : device_(device), dtype_(dtype), kernels_(kernels), staging_(std::move(staging)) {}

  /// The wire bytes as [rows, features] on the compute device: no copy on CPU in float32; on CUDA
  /// through a pinned staging buffer (LibTorch's caching host allocator) and a non-blocking copy on
  /// the worker's stream.
  at::Tensor InputRows(const TensorView& v) const;

  /// The batch's rows as `plan` packs them: queries [plan.q_rows, e], keys [plan.k_rows, kdim] and
  /// values [plan.k_rows, vdim].
  PackedRows Pack(const std::vector<const AttendCall*>& calls, const PackingPlan& plan, int64_t e,
                  int64_t kdim, int64_t vdim, StageClock* clock) const;

  /// CUDA: the batch's answers (y [rows, E], call i's at rows q_off[i]), converted to the wire's
  /// dtype on the device, copied back in one asynchronous copy into a pinned staging block that
  /// each call's answer then points into (AttendOutputs::output_block: sent from there, no further
  /// copy). False when the staging has no room (the caller writes each answer into its response
  /// instead) or a call wants weights.
  bool AnswersToStaging(const std::vector<const AttendCall*>& calls,
                        const std::vector<Attended>& attended, const at::Tensor& y,
                        const std::vector<int64_t>& q_off, const std::vector<AttendOutputs*>& outs,
                        const StageClock& clock) const;

 private:
  std::vector<at::Tensor> WireTensors(const std::vector<const AttendCall*>& calls,
                                      std::vector<std::shared_ptr<void>>* held,
                                      StageClock* clock) const;

  at::Device device_;
  at::ScalarType dtype_;
  small_attention::Isa kernels_;
  std::shared_ptr<HostStaging> staging_;
};

}  // namespace attnserve
