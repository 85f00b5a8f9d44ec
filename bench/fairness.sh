#!/usr/bin/env bash
# Tenants and priorities on one server, FCFS against fair, side by side in one run (issue 41,
# docs/tenants.md); prints the tables and the goals, and fails below a goal:
#   bench/fairness.sh [DURATION_S (10)] [--only-throughput --rounds N]
# Builds attnserve and attnserve-bench, then bench/fairness.py runs every scenario (a server a
# scenario, each tenant an attnserve-bench process sending its name in the attnserve-tenant header).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${ATTNSERVE_BUILD_DIR:-build}
cmake --build "$build" -j"$(nproc)" --target attnserve attnserve_bench >/dev/null
exec /usr/bin/python3 bench/fairness.py --build "$build" --duration "${1:-10}" "${@:2}"
