#include "server/v1/shared_tensors.h"

namespace attnserve {
namespace {

namespace pb = ::attnserve::v1;

// The region `ref` names, checked: the window fits, the region is registered.
StatusOr<RegionRef> Resolve(const SharedMemoryRegistry& shm, const pb::SharedMemoryRef& ref,
                            const std::string& field) {
  RegionRef r;
  ASSIGN_OR_RETURN(r.region, shm.Find(ref.region()));
  r.offset = ref.offset();
  r.byte_size = ref.byte_size();
  RETURN_IF_ERROR(r.region->Check(r.offset, r.byte_size, field + ".shared_memory"));
  return r;
}

// One tensor's bytes from its region: into `staged` when given (a pinned block), else its data.
Status ReadTensor(const SharedMemoryRegistry& shm, HostStaging* staging, const char* field,
                  pb::Tensor* t, BlockBytes* staged, SharedTensors* out) {
  if (!t->has_shared_memory()) return Status::Ok();
  if (!t->data().empty()) {
    return InvalidArgument(std::string(field) +
                           ": both data and shared_memory given; send one or the other");
  }
  ASSIGN_OR_RETURN(RegionRef r, Resolve(shm, t->shared_memory(), field));
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

Status ReadSharedTensors(const SharedMemoryRegistry& shm, HostStaging* staging,
                         pb::AttendRequest* r, StagedInputs* staged, SharedTensors* out,
                         OutputLimits* limits) {
  RETURN_IF_ERROR(ReadTensor(shm, staging, "query", r->mutable_query(), &staged->query, out));
  if (r->has_key())
    RETURN_IF_ERROR(ReadTensor(shm, staging, "key", r->mutable_key(), &staged->key, out));
  if (r->has_value())
    RETURN_IF_ERROR(ReadTensor(shm, staging, "value", r->mutable_value(), &staged->value, out));
  if (r->has_key_padding_mask()) {
    RETURN_IF_ERROR(
        ReadTensor(shm, nullptr, "key_padding_mask", r->mutable_key_padding_mask(), nullptr, out));
  }
  if (r->has_attn_mask())
    RETURN_IF_ERROR(ReadTensor(shm, nullptr, "attn_mask", r->mutable_attn_mask(), nullptr, out));
  if (r->has_output_shared_memory()) {
    ASSIGN_OR_RETURN(out->output, Resolve(shm, r->output_shared_memory(), "output_shared_memory"));
    limits->output = {out->output->byte_size,
                      "output_shared_memory (region '" + out->output->region->info().name + "')"};
  }
  if (r->has_attn_weights_shared_memory()) {
    ASSIGN_OR_RETURN(out->weights,
                     Resolve(shm, r->attn_weights_shared_memory(), "attn_weights_shared_memory"));
    limits->weights = {out->weights->byte_size, "attn_weights_shared_memory (region '" +
                                                    out->weights->region->info().name + "')"};
  }
  return Status::Ok();
}

Status ReadSharedTensors(const SharedMemoryRegistry& shm, pb::CreateMemoryRequest* r,
                         SharedTensors* out) {
  RETURN_IF_ERROR(ReadTensor(shm, nullptr, "key", r->mutable_key(), nullptr, out));
  RETURN_IF_ERROR(ReadTensor(shm, nullptr, "value", r->mutable_value(), nullptr, out));
  if (r->has_key_padding_mask()) {
    RETURN_IF_ERROR(
        ReadTensor(shm, nullptr, "key_padding_mask", r->mutable_key_padding_mask(), nullptr, out));
  }
  return Status::Ok();
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
