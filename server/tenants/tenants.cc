#include "server/tenants/tenants.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "server/core/files.h"
#include "server/weights/safetensors.h"

namespace attnserve {
namespace {

Status Fail(const std::string& m) { return {StatusCode::kFailedPrecondition, m}; }

constexpr char kTenantPlaceholder[] = "{tenant}";
constexpr size_t kMaxKeyPrefix = 200;

// A value as a message shows it: a file may hold megabytes where a string or number belongs.
std::string Shown(const nlohmann::json& v) {
  const std::string text = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return text.size() <= 64 ? text : text.substr(0, 64) + "...";
}

bool KeyPrefixChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

// Only characters every POSIX shared-memory name may hold, so that no prefix carries a '/' (a
// path inside the name space) or anything a key could not start with.
StatusOr<std::string> ParseKeyPrefix(const nlohmann::json& v, const std::string& key) {
  const std::string allowed = "; allowed: a string of at most " + std::to_string(kMaxKeyPrefix) +
                              " characters: letters, digits, '.', '_', '-' and \"" +
                              kTenantPlaceholder + "\"";
  if (!v.is_string()) return Fail(key + " is " + Shown(v) + allowed);
  const std::string& s = v.get_ref<const std::string&>();
  if (s.size() > kMaxKeyPrefix) {
    return Fail(key + " has " + std::to_string(s.size()) + " characters" + allowed);
  }
  const size_t placeholder = sizeof kTenantPlaceholder - 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s.compare(i, placeholder, kTenantPlaceholder) == 0) {
      // Names under a placeholder hold no '.', so "a." never starts tenant "a.b"'s keys.
      if (i + placeholder >= s.size() || s[i + placeholder] != '.') {
        return Fail(
            key + " is " + Shown(v) + ": \"" + kTenantPlaceholder +
            "\" must be followed by '.' (a tenant's prefix must not be the start of another's)");
      }
      i += placeholder - 1;
    } else if (!KeyPrefixChar(s[i])) {
      return Fail(key + " is " + Shown(v) + ", with a character not allowed at offset " +
                  std::to_string(i) + allowed);
    }
  }
  return s;
}

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
    } else if (it.key() == "best_priority_level") {
      StatusOr<int64_t> level = NonNegativeJsonInt(*it, key);
      if (!level.ok()) {
        return Fail(key + " is " + Shown(*it) +
                    "; allowed: 0 (no cap) or a priority level from 1 (the most urgent)");
      }
      p.best_priority_level = *level;
    } else if (it.key() == "shared_memory_max_bytes") {
      ASSIGN_OR_RETURN(p.shared_memory_max_bytes, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "shared_memory_max_regions") {
      ASSIGN_OR_RETURN(p.shared_memory_max_regions, NonNegativeJsonInt(*it, key));
    } else if (it.key() == "shared_memory_key_prefix") {
      ASSIGN_OR_RETURN(p.shared_memory_key_prefix, ParseKeyPrefix(*it, key));
    } else {
      return Fail(field + ": unknown key '" + it.key().substr(0, 128) +
                  "'; allowed: weight, max_queued_requests, kv_guaranteed_bytes, kv_max_bytes, "
                  "best_priority_level, shared_memory_max_bytes, shared_memory_max_regions, "
                  "shared_memory_key_prefix");
    }
  }
  if (p.kv_max_bytes > 0 && p.kv_guaranteed_bytes > p.kv_max_bytes) {
    return Fail(field + ".kv_guaranteed_bytes (" + std::to_string(p.kv_guaranteed_bytes) +
                ") is above its kv_max_bytes (" + std::to_string(p.kv_max_bytes) + ")");
  }
  return p;
}

}  // namespace

StatusOr<std::string> SharedMemoryKeyPrefix(const TenantPolicy& terms, const std::string& tenant) {
  const std::string& text = terms.shared_memory_key_prefix;
  const size_t placeholder = sizeof kTenantPlaceholder - 1;
  std::string out;
  size_t from = 0;
  for (size_t at; (at = text.find(kTenantPlaceholder, from)) != std::string::npos;
       from = at + placeholder) {
    for (char c : tenant) {
      if (!KeyPrefixChar(c) || c == '.') {
        return Status(StatusCode::kPermissionDenied,
                      "shared memory: tenant '" + tenant.substr(0, 128) +
                          "' cannot stand in its shared_memory_key_prefix '" + text +
                          "' (tenants file): a name there holds only letters, digits, '_' and "
                          "'-'; the operator gives such a tenant an entry of its own");
      }
    }
    out.append(text, from, at - from).append(tenant);
  }
  return out.append(text, from, std::string::npos);
}

std::vector<std::string> Tenants::KeyPrefixesBeside(const std::string& tenant) const {
  std::vector<std::string> out;
  for (const auto& [name, p] : named_) {
    if (name == tenant) continue;
    StatusOr<std::string> prefix = SharedMemoryKeyPrefix(p, name);
    if (prefix.ok() && !prefix->empty()) out.push_back(std::move(prefix).value());
  }
  return out;
}

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
