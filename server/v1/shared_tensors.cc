#include "server/v1/shared_tensors.h"

#include <optional>
#include <string>
#include <utility>

#include "server/core/checked_math.h"
#include "server/core/wire.h"

namespace attnserve {
namespace {

namespace pb = ::attnserve::v1;

// The region `ref` names, checked: the window fits, the region is registered.
StatusOr<RegionRef> Resolve(const TenantRegions& shm, const pb::SharedMemoryRef& ref,
                            const std::string& field) {
  RegionRef r;
  ASSIGN_OR_RETURN(r.region, shm.Find(ref.region()));
  r.offset = ref.offset();
  r.byte_size = ref.byte_size();
  RETURN_IF_ERROR(r.region->Check(r.offset, r.byte_size, field + ".shared_memory"));
  return r;
}

// One input tensor's region, checked before any byte of it is read: the window fits its region
// and holds exactly what the tensor's dtype and shape take. nullopt: the tensor names no region.
StatusOr<std::optional<RegionRef>> Window(const TenantRegions& shm, const char* field,
                                          const pb::Tensor& t) {
  if (!t.has_shared_memory()) return std::optional<RegionRef>();
  if (!t.data().empty()) {
    return InvalidArgument(std::string(field) +
                           ": both data and shared_memory given; send one or the other");
  }
  ASSIGN_OR_RETURN(RegionRef r, Resolve(shm, t.shared_memory(), field));
  RETURN_IF_ERROR(CheckTensorWindow(t, r.byte_size, std::string(field) + ".shared_memory"));
  return std::optional<RegionRef>(std::move(r));
}

// One tensor's bytes from its region (its window checked by Window): into `staged` when given (a
// pinned block), else its data.
Status ReadTensor(HostStaging* staging, const char* field, RegionRef r, pb::Tensor* t,
                  BlockBytes* staged, SharedTensors* out) {
  char* block = nullptr;
  std::shared_ptr<void> owner;
  if (staging != nullptr && staged != nullptr && r.byte_size > 0)
    owner = staging->Allocate(static_cast<size_t>(r.byte_size), &block);
  if (owner) {
    RETURN_IF_ERROR(r.region->Read(r.offset, r.byte_size, block, field));
    *staged = {std::move(owner), block, static_cast<size_t>(r.byte_size)};
  } else {
    t->mutable_data()->resize(static_cast<size_t>(r.byte_size));
    RETURN_IF_ERROR(r.region->Read(r.offset, r.byte_size, t->mutable_data()->data(), field));
  }
  t->clear_shared_memory();
  out->held.push_back(std::move(r.region));
  return Status::Ok();
}

}  // namespace

bool NamesSharedMemory(const pb::AttendRequest& r) {
  return r.query().has_shared_memory() || r.key().has_shared_memory() ||
         r.value().has_shared_memory() || r.key_padding_mask().has_shared_memory() ||
         r.attn_mask().has_shared_memory() || r.has_output_shared_memory() ||
         r.has_attn_weights_shared_memory();
}

bool NamesSharedMemory(const pb::CreateMemoryRequest& r) {
  return r.key().has_shared_memory() || r.value().has_shared_memory() ||
         r.key_padding_mask().has_shared_memory();
}

namespace {

// A request's input tensors in regions: each window checked, and all of them together within
// `max_bytes`, before any is read; then read, the query, key and value into `staged` when given.
struct Input {
  const char* field;
  pb::Tensor* tensor;
  BlockBytes* staged;  // Null: into the tensor's data.
};
Status ReadInputs(const TenantRegions& shm, HostStaging* staging, const std::vector<Input>& inputs,
                  int64_t max_bytes, SharedTensors* out) {
  std::vector<std::optional<RegionRef>> windows;
  int64_t total = 0;
  for (const Input& in : inputs) {
    ASSIGN_OR_RETURN(std::optional<RegionRef> w, Window(shm, in.field, *in.tensor));
    if (w) total = CheckedAdd(total, w->byte_size).value_or(INT64_MAX);
    windows.push_back(std::move(w));
  }
  RETURN_IF_ERROR(CheckRegionInputBytes(total, max_bytes));
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!windows[i]) continue;
    RETURN_IF_ERROR(ReadTensor(inputs[i].staged ? staging : nullptr, inputs[i].field,
                               std::move(*windows[i]), inputs[i].tensor, inputs[i].staged, out));
  }
  return Status::Ok();
}

}  // namespace

Status ReadSharedTensors(const TenantRegions& shm, HostStaging* staging, pb::AttendRequest* r,
                         StagedInputs* staged, SharedTensors* out, OutputLimits* limits,
                         int64_t max_input_bytes) {
  std::vector<Input> inputs = {{"query", r->mutable_query(), &staged->query}};
  if (r->has_key()) inputs.push_back({"key", r->mutable_key(), &staged->key});
  if (r->has_value()) inputs.push_back({"value", r->mutable_value(), &staged->value});
  if (r->has_key_padding_mask())
    inputs.push_back({"key_padding_mask", r->mutable_key_padding_mask(), nullptr});
  if (r->has_attn_mask()) inputs.push_back({"attn_mask", r->mutable_attn_mask(), nullptr});
  RETURN_IF_ERROR(ReadInputs(shm, staging, inputs, max_input_bytes, out));
  if (r->has_output_shared_memory()) {
    ASSIGN_OR_RETURN(out->output, Resolve(shm, r->output_shared_memory(), "output_shared_memory"));
    RETURN_IF_ERROR(out->output->region->CheckWritable("output_shared_memory"));
    limits->output = {out->output->byte_size,
                      "output_shared_memory (region '" + out->output->region->info().name + "')"};
  }
  if (r->has_attn_weights_shared_memory()) {
    ASSIGN_OR_RETURN(out->weights,
                     Resolve(shm, r->attn_weights_shared_memory(), "attn_weights_shared_memory"));
    RETURN_IF_ERROR(out->weights->region->CheckWritable("attn_weights_shared_memory"));
    limits->weights = {out->weights->byte_size, "attn_weights_shared_memory (region '" +
                                                    out->weights->region->info().name + "')"};
  }
  return Status::Ok();
}

Status ReadSharedTensors(const TenantRegions& shm, pb::CreateMemoryRequest* r, SharedTensors* out,
                         int64_t max_input_bytes) {
  std::vector<Input> inputs = {{"key", r->mutable_key(), nullptr},
                               {"value", r->mutable_value(), nullptr}};
  if (r->has_key_padding_mask())
    inputs.push_back({"key_padding_mask", r->mutable_key_padding_mask(), nullptr});
  return ReadInputs(shm, nullptr, inputs, max_input_bytes, out);
}

Status WriteSharedTensors(const SharedTensors& shared, AttendAnswer* answer) {
  if (shared.output) {
    const RegionRef& r = *shared.output;
    const bool block = static_cast<bool>(answer->output_block);
    const char* data = block ? answer->output_block.data : answer->output->data();
    const size_t size = block ? answer->output_block.size : answer->output->size();
    RETURN_IF_ERROR(
        r.region->Write(r.offset, data, static_cast<int64_t>(size), "output_shared_memory"));
    answer->output.reset();
    answer->output_block = BlockBytes();
  }
  if (shared.weights && answer->weights) {
    const RegionRef& r = *shared.weights;
    RETURN_IF_ERROR(r.region->Write(r.offset, answer->weights->data(),
                                    static_cast<int64_t>(answer->weights->size()),
                                    "attn_weights_shared_memory"));
    answer->weights.reset();
  }
  return Status::Ok();
}

}  // namespace attnserve
