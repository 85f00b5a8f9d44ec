#!/usr/bin/env bash
# Times one compile: the build trees' compiler launcher runs it before ccache
# (cmake/AttnserveCcache.cmake). When ATTNSERVE_COMPILE_TIMES names a file, appends
# "CPU_MS WALL_MS OBJECT" to it (the compiler's user plus system time, and the wall time; one short
# line, so appends from parallel compiles do not interleave); otherwise only runs the command.
# tools/build.sh sums them up (where a run's compile time went).
[ -n "${ATTNSERVE_COMPILE_TIMES:-}" ] || exec "$@"
start=$(date +%s%N)
"$@"
rc=$?
wall=$((($(date +%s%N) - start) / 1000000))
# The waited-for children's user and system time: /proc's stat fields 16 and 17, in clock ticks
# (100 a second), read without a fork.
read -r -a stat </proc/$$/stat
cpu=$(((stat[15] + stat[16]) * 10))
out="" prev=""
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  prev=$a
done
echo "$cpu $wall $PWD/$out" >>"$ATTNSERVE_COMPILE_TIMES"
exit $rc
