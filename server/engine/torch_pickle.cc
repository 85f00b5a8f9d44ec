// Reads torch.save()'d state_dicts. A LibTorch translation unit: keep it small.
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "server/engine/attention_model.h"
#include "server/engine/safetensors.h"

namespace attnserve {

StatusOr<NamedTensors> ReadTorchStateDict(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  const std::vector<char> data(bytes.begin(), bytes.end());
  bytes.clear();
  try {
    const c10::IValue value = torch::jit::pickle_load(data);
    if (!value.isGenericDict()) {
      return Status(StatusCode::kFailedPrecondition,
                    path + ": holds a " + value.tagKind() +
                        ", expected a state_dict (torch.save(module.state_dict()))");
    }
    NamedTensors out;
    for (const auto& entry : value.toGenericDict()) {
      if (!entry.key().isString() || !entry.value().isTensor()) {
        return Status(StatusCode::kFailedPrecondition,
                      path + ": state_dict entries must map names to tensors");
      }
      const at::Tensor t = entry.value().toTensor().to(at::kFloat).contiguous();
      HostTensor h;
      h.shape = t.sizes().vec();
      h.values.assign(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
      out.emplace(entry.key().toStringRef(), std::move(h));
    }
    return out;
  } catch (const c10::Error& e) {
    return Status(StatusCode::kFailedPrecondition,
                  path + ": not a readable torch.save() archive: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status(StatusCode::kFailedPrecondition,
                  path + ": not a readable torch.save() archive: " + e.what());
  }
}

}  // namespace attnserve
