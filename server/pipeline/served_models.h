#pragma once
// What is served, as the front ends' metadata and readiness calls see it.

#include <cstdint>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "server/core/status.h"
#include "server/core/types.h"

namespace attnserve {

/// The models loaded now, described.
class ServedModels {
 public:
  virtual ~ServedModels() = default;
  /// Every loaded version of every model.
  virtual void ListModels(v1::ListModelsResponse* resp) const = 0;
  /// One model version's description (version 0: the highest loaded).
  virtual Status GetModel(const v1::GetModelRequest& req, v1::ModelInfo* resp) const = 0;
  /// A loaded model version's spec and every loaded version of it (NOT_FOUND naming what is there).
  virtual StatusOr<ModelSpec> Describe(const std::string& model, int64_t version,
                                       std::vector<int64_t>* versions) const = 0;
  /// Whether requests for `model` (version 0: the highest) would be served now: loaded, warm and
  /// not draining. An empty `model`: whether the server takes requests at all.
  virtual bool Ready(const std::string& model, int64_t version) const = 0;
};

}  // namespace attnserve
