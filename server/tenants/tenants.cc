#include "server/tenants/tenants.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "server/core/files.h"
#include "server/weights/safetensors.h"

namespace attnserve {
namespace {

Status Fail(const std::string& m) { return {StatusCode::kFailedPrecondition, m}; }

StatusOr<TenantPolicy> ParsePolicy(const nlohmann::json& j, const std::string& field) {
  if (!j.is_object()) return Fail(field + ": expected an object, got " + j.dump());
  TenantPolicy p;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = field + "." + it.key();
    if (it.key() == "weight") {
      if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() <= 0 ||
          it->get<double>() > 1e6) {
        return Fail(key + " is " + it->dump() + "; allowed: a number above 0, at most 1e6");
      }
      p.weight = it->get<double>();
    } else if (it.key() == "max_queued_requests") {
      ASSIGN_OR_RETURN(p.max_queued_requests, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "kv_guaranteed_bytes") {
      ASSIGN_OR_RETURN(p.kv_guaranteed_bytes, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "kv_max_bytes") {
      ASSIGN_OR_RETURN(p.kv_max_bytes, NonNegativeJsonInt(*it, key));
    } else {
      return Fail(field + ": unknown key '" + it.key() +
                  "'; allowed: weight, max_queued_requests, kv_guaranteed_bytes, kv_max_bytes");
    }
  }
  if (p.kv_max_bytes > 0 && p.kv_guaranteed_bytes > p.kv_max_bytes) {
    return Fail(field + ".kv_guaranteed_bytes (" + std::to_string(p.kv_guaranteed_bytes) +
                ") is above its kv_max_bytes (" + std::to_string(p.kv_max_bytes) + ")");
  }
  return p;
}

}  // namespace

bool ValidTenantName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

StatusOr<std::shared_ptr<const Tenants>> Tenants::Load(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path, 1 << 20));
  return Parse(text, path);
}

StatusOr<std::shared_ptr<const Tenants>> Tenants::Parse(const std::string& text,
                                                        const std::string& where) {
  StatusOr<nlohmann::json> parsed = ParseStrictJson(text, where);
  if (!parsed.ok()) return Fail(parsed.status().message());
  const nlohmann::json& j = *parsed;
  if (!j.is_object()) return Fail(where + ": not a JSON object");
  auto out = std::make_shared<Tenants>();
  out->source_ = where;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "default") {
      ASSIGN_OR_RETURN(out->default_, ParsePolicy(*it, where + ": default"));
    } else if (it.key() == "tenants") {
      if (!it->is_object()) return Fail(where + ": tenants: expected an object of tenant names");
      for (auto t = it->begin(); t != it->end(); ++t) {
        if (!ValidTenantName(t.key()) || t.key() == kDefaultTenant || t.key() == "other") {
          return Fail(where + ": tenants: the name '" + t.key().substr(0, 128) +
                      "' cannot name a tenant (1 to 128 printable characters without spaces, "
                      "not 'default' or 'other')");
        }
        ASSIGN_OR_RETURN(out->named_[t.key()],
                         ParsePolicy(*t, where + ": tenants['" + t.key() + "']"));
      }
    } else {
      return Fail(where + ": unknown key '" + it.key() + "'; allowed: default, tenants");
    }
  }
  return std::shared_ptr<const Tenants>(std::move(out));
}

Status Tenants::CheckAgainst(int64_t budget) const {
  const std::string where = source_.empty() ? "tenants" : source_;
  // Summed in long double: a file may give values up to INT64_MAX each.
  long double guaranteed = default_.kv_guaranteed_bytes;
  for (const auto& [name, p] : named_) guaranteed += p.kv_guaranteed_bytes;
  if (guaranteed > static_cast<long double>(budget)) {
    return Fail(where + ": the kv_guaranteed_bytes of default and every named tenant add up to " +
                std::to_string(static_cast<double>(guaranteed)) +
                " bytes, more than --kv-budget-bytes " + std::to_string(budget));
  }
  return Status::Ok();
}

const TenantPolicy& Tenants::Of(const std::string& tenant) const {
  auto it = named_.find(tenant);
  return it == named_.end() ? default_ : it->second;
}

std::string Tenants::Label(const std::string& tenant) const {
  if (tenant == kDefaultTenant || named_.count(tenant)) return tenant;
  return "other";
}

std::vector<std::string> Tenants::Labels() const {
  std::vector<std::string> labels{kDefaultTenant};
  for (const auto& [name, p] : named_) labels.push_back(name);
  labels.push_back("other");
  return labels;
}

}  // namespace attnserve
