#include "server/core/scheduling.h"

#include <algorithm>
#include <limits>
#include <sstream>

namespace attnserve {
namespace {

Status Fail(const std::string& m) { return {StatusCode::kFailedPrecondition, m}; }

bool ParseInt(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 18) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  *out = std::stoll(s);
  return true;
}

Status CheckPolicy(const QueuePolicy& p, const std::string& field) {
  if (p.max_queue_size < 0) {
    return Fail(field + ".max_queue_size is " + std::to_string(p.max_queue_size) +
                "; allowed: 0 (no bound of its own) or more");
  }
  if (p.default_timeout_us < 0) {
    return Fail(field + ".default_timeout_microseconds is " + std::to_string(p.default_timeout_us) +
                "; allowed: 0 (none) or more");
  }
  return Status::Ok();
}

Status SetPolicyKey(const std::string& key, const std::string& value, QueuePolicy* p,
                    const std::string& where) {
  int64_t n = 0;
  if (key == "max_queue_size" || key == "default_timeout_microseconds") {
    if (!ParseInt(value, &n)) {
      return Fail(where + ": " + key + "='" + value + "'; expected an integer from 0 to 10^18");
    }
    (key == "max_queue_size" ? p->max_queue_size : p->default_timeout_us) = n;
  } else if (key == "allow_timeout_override") {
    if (value != "true" && value != "false") {
      return Fail(where + ": allow_timeout_override='" + value + "'; expected true or false");
    }
    p->allow_timeout_override = value == "true";
  } else if (key == "timeout_action") {
    if (!ParseTimeoutAction(value, &p->timeout_action)) {
      return Fail(where + ": timeout_action='" + value + "'; expected REJECT or DELAY");
    }
  } else {
    return Fail(where + ": unknown key '" + key +
                "'; allowed: max_queue_size, default_timeout_microseconds, "
                "allow_timeout_override, timeout_action");
  }
  return Status::Ok();
}

}  // namespace

const char* TimeoutActionName(TimeoutAction action) {
  return action == TimeoutAction::kDelay ? "DELAY" : "REJECT";
}

bool ParseTimeoutAction(const std::string& name, TimeoutAction* action) {
  if (name == "REJECT") {
    *action = TimeoutAction::kReject;
  } else if (name == "DELAY") {
    *action = TimeoutAction::kDelay;
  } else {
    return false;
  }
  return true;
}

Status PriorityOptions::Validate(const std::string& where) const {
  constexpr int64_t kMaxLevels = 1 << 20;
  if (levels < 0 || levels > kMaxLevels) {
    return Fail(where + ": priority_levels is " + std::to_string(levels) + "; allowed: 0 to " +
                std::to_string(kMaxLevels));
  }
  if (default_level < 0 || default_level > levels) {
    return Fail(where + ": default_priority_level is " + std::to_string(default_level) +
                "; allowed: 0 (the lowest level) to priority_levels (" + std::to_string(levels) +
                ")");
  }
  RETURN_IF_ERROR(CheckPolicy(default_policy, where + ": default_queue_policy"));
  for (const auto& [level, policy] : level_policies) {
    if (level < 1 || level > levels) {
      return Fail(where + ": priority_queue_policy names level " + std::to_string(level) +
                  "; allowed: 1 to priority_levels (" + std::to_string(levels) + ")");
    }
    RETURN_IF_ERROR(
        CheckPolicy(policy, where + ": priority_queue_policy[" + std::to_string(level) + "]"));
  }
  return Status::Ok();
}

StatusOr<int64_t> PriorityOptions::LevelOf(uint64_t priority) const {
  if (levels == 0) return int64_t{0};
  if (priority == 0) return default_level == 0 ? levels : default_level;
  if (priority > static_cast<uint64_t>(levels)) {
    return InvalidArgument("priority: " + std::to_string(priority) + "; allowed: 0 (the default, " +
                           std::to_string(default_level == 0 ? levels : default_level) +
                           ") or 1 (first) to " + std::to_string(levels));
  }
  return static_cast<int64_t>(priority);
}

StatusOr<int64_t> PriorityOptions::LevelOf(uint64_t priority, int64_t best_level) const {
  ASSIGN_OR_RETURN(const int64_t level, LevelOf(priority));
  if (levels == 0 || best_level <= 0) return level;
  // One file's cap serves models with any number of levels: past a model's last, its lowest.
  return std::max(level, std::min(best_level, levels));
}

const QueuePolicy& PriorityOptions::PolicyOf(int64_t level) const {
  auto it = level_policies.find(level);
  return it == level_policies.end() ? default_policy : it->second;
}

int64_t PriorityOptions::TimeoutUs(int64_t level, uint64_t requested_us) const {
  const QueuePolicy& p = PolicyOf(level);
  const uint64_t max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  const int64_t requested = static_cast<int64_t>(requested_us > max ? max : requested_us);
  if (p.allow_timeout_override && requested > 0 &&
      (p.default_timeout_us == 0 || requested < p.default_timeout_us)) {
    return requested;
  }
  return p.default_timeout_us;
}

Status ParseQueuePolicyFlag(const std::string& spec, PriorityOptions* into) {
  const std::string where = "--queue-policy '" + spec + "'";
  const size_t colon = spec.find(':');
  if (colon == std::string::npos) {
    return Fail(where + ": expected LEVEL:key=value,... or default:key=value,...");
  }
  const std::string level = spec.substr(0, colon);
  int64_t n = 0;
  QueuePolicy* policy = nullptr;
  if (level == "default") {
    policy = &into->default_policy;
  } else if (ParseInt(level, &n) && n >= 1) {
    auto it = into->level_policies.find(n);
    if (it == into->level_policies.end()) {
      it = into->level_policies.emplace(n, into->default_policy).first;
    }
    policy = &it->second;
  } else {
    return Fail(where + ": level '" + level + "'; expected default or a level from 1");
  }
  std::stringstream pairs(spec.substr(colon + 1));
  std::string pair;
  while (std::getline(pairs, pair, ',')) {
    const size_t eq = pair.find('=');
    if (eq == std::string::npos) return Fail(where + ": '" + pair + "' is not key=value");
    RETURN_IF_ERROR(SetPolicyKey(pair.substr(0, eq), pair.substr(eq + 1), policy, where));
  }
  return Status::Ok();
}

}  // namespace attnserve
