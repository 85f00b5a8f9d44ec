#pragma once

namespace attnserve {

/// The cores this process may compute on: those its CPU affinity allows (taskset, cpusets), capped
/// by a cgroup CPU quota (a container's --cpus, a Kubernetes CPU limit), rounded up; at least 1.
/// The default number of compute threads (--workers) is this, so that one worker runs per usable
/// core.
int UsableCpus();

}  // namespace attnserve
