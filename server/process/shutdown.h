#pragma once
// The stop, in one place (shutdown.cc). In-process users call Server::Shutdown; the executable
// calls StopProcess.

#include "server/process/server.h"

namespace attnserve {

/// The executable's stop after SIGINT/SIGTERM: Server::Shutdown, bounded by `grace` seconds (past
/// them the process exits, 1 when calls were cut), then the process exits at once with 0 when every
/// call accepted was answered and read, 1 when the grace period cut calls or answers
/// (docs/shutdown.md "Shutdown"). Never returns.
[[noreturn]] void StopProcess(Server& server, double grace);

}  // namespace attnserve
