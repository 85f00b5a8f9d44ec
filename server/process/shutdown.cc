// Stopping attnserve, in one place: the hand-off (health NOT_SERVING, streams closed to new
// requests), gRPC's stop with idle connections closed and what is still open at the end of the
// grace period cut, the lingering close of client connections, and for the executable the
// grace-period watchdog and the exit code. Several steps work around gRPC 1.51
// (docs/grpc-workarounds.md).
#include "server/process/shutdown.h"

#include <grpc/grpc.h>
#include <unistd.h>

#include <cstdio>
#include <future>
#include <iostream>
#include <sstream>
#include <thread>

#include "server/process/server_impl.h"

namespace attnserve {
namespace {

/// The drain's hand-off: health says NOT_SERVING and unary calls are still served, until nothing is
/// in flight, no stream is open and no request has arrived for kDrainQuietPeriod (clients that
/// watch health have moved away), or for at most kDrainHandOff (a proxy such as nginx does not
/// watch health and keeps sending until the transport tells it to stop). Then gRPC stops: it closes
/// the listener and sends GOAWAY, which is what moves a proxy to the other replicas.
constexpr std::chrono::milliseconds kDrainQuietPeriod{250};
constexpr std::chrono::milliseconds kDrainHandOff{1000};
/// How often the stop looks again for connections left with no call on them.
constexpr std::chrono::milliseconds kIdleCloseInterval{20};
/// How long no call must have begun before the stop closes the connections left: calls gRPC took
/// in just before it stopped reach their handlers within it.
constexpr std::chrono::milliseconds kCallsSettle{100};

}  // namespace

void Server::Impl::HoldConnections() {
  if (options.lingering_close) outcome->connections_held = linger.HoldConnectionsOn(port);
}

void Server::Impl::StopGrpc(SteadyClock::time_point cut_at, SteadyClock::time_point backstop) {
  const auto system_backstop =
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::max(backstop - SteadyClock::now(), SteadyClock::duration::zero()));
  // Held before gRPC may close any, so that no answer still travelling is reset (SocketLinger).
  HoldConnections();
  std::future<void> stopped = std::async(
      std::launch::async, [this, system_backstop] { grpc_server->Shutdown(system_backstop); });
  // gRPC's Shutdown also waits for every connection to close, which each client does only once it
  // has read the GOAWAY: a grpcio client with no call open reads it at its next backup poll, up to
  // 5 s later, and a client's health watch stays open until cut. So once no call attnserve took is
  // open, what is left is closed at once (and again, until gRPC is done, in case a connection
  // slipped in before the listener closed: it is held too). The first look waits a moment so
  // gRPC's own shutdown has begun. At `cut_at` the calls still open are cancelled, and each that
  // then ends cancelled is counted as cut. (gRPC's own deadline, `backstop`, comes later.)
  while (stopped.wait_for(kIdleCloseInterval) != std::future_status::ready) {
    HoldConnections();
    const bool none = calls->WaitNone(cut_at, kCallsSettle);
    if (!none) calls->BeginCut();
    grpc_server_cancel_all_calls(grpc_server->c_server());
    if (!none) break;
  }
  stopped.wait();
}

void Server::Shutdown() {
  std::call_once(impl_->shutdown_once, [this] {
    const auto start = SteadyClock::now();
    const auto grace = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(impl_->options.shutdown_grace_seconds));
    // 1. Hand off while gRPC still serves: load balancers see NOT_SERVING, unary calls are served
    //    as before, open streams take no new requests and finish once answered (their clients
    //    reopen elsewhere). Calls that reach a gRPC server already shutting down are cancelled by
    //    gRPC itself (CANCELLED, see docs/shutdown.md "Shutdown"), so the hand-off first gives
    //    clients that watch health the time to leave.
    impl_->HoldConnections();  // Answers sent from now on are read whole.
    impl_->watch.reset();      // The listener closes on purpose now.
    // Answers their callers do not take are cancelled within 40% of the grace period, so that a
    // caller that never reads cannot hold the stop to its end.
    impl_->calls->sends().SetCap(grace * 4 / 10);
    impl_->health->Shutdown();
    impl_->pipeline->BeginDrain();
    if (impl_->http) impl_->http->BeginDrain();  // Its answers close their connections from now.
    impl_->models->Stop();  // Reloads waiting are answered UNAVAILABLE; none starts.
    impl_->pipeline->WaitIdle(
        start + std::min<SteadyClock::duration>(kDrainHandOff, grace * 8 / 10), kDrainQuietPeriod);
    // HTTP takes no new connection; its requests accepted are answered and sent (until 90% of
    // the grace period), then its connections close.
    const int64_t http_cut = impl_->http ? impl_->http->Stop(start + grace * 9 / 10) : 0;
    // 2. Stop gRPC: listener closed, GOAWAY; calls accepted finish; whatever is still open at 90%
    //    of the grace period is cancelled. Then the queue drains (work still computing finishes).
    impl_->StopGrpc(start + grace * 9 / 10, start + grace * 19 / 20);
    impl_->batcher->Drain();
    impl_->grpc_server->Wait();
    ConnectionGuard::Get().Unguard(impl_->port);
    if (impl_->unix_listener) {
      ConnectionGuard::Get().Unguard(impl_->unix_listener->GuardKey());
      impl_->unix_listener->Remove();  // PATH, while it is still this server's socket.
    }
    impl_->shm->Clear();  // Every region closed (one a late request still holds, once it is done).
    if (impl_->health_server) {
      // Health only: its checks are answered at once, its watches are cut.
      impl_->health_server->Shutdown(std::chrono::system_clock::now());
      impl_->health_server->Wait();
      ConnectionGuard::Get().Unguard(impl_->health_port);
    }
    // 3. gRPC has closed its connections; ours close once their clients have everything.
    // HTTP answers still being sent at 90% of the grace period were cut short too.
    impl_->outcome->connections_unread =
        impl_->linger.CloseWhenRead(start + grace * 19 / 20) + http_cut;
    // Every call is answered: its spans are queued. They go to the collector (one last try, within
    // the export timeout) before the process does.
    if (impl_->exporter) impl_->exporter->Shutdown();
    impl_->exposer.reset();
    impl_->models.reset();
  });
}

namespace {

// "the grace period (--shutdown-grace G s) cut N calls ..."
std::string CutLine(double grace, int64_t cut) {
  std::ostringstream line;
  line << "attnserve: the grace period (--shutdown-grace " << grace << " s) cut " << cut
       << (cut == 1 ? " call" : " calls")
       << " still in flight (their clients got CANCELLED or UNAVAILABLE); exit 1";
  return line.str();
}

}  // namespace

// Past the grace period the process goes, whatever is still computing (a promise to the
// orchestrator): exit 1 when calls were cut, else 0.
void StartWatchdog(std::shared_ptr<const ShutdownOutcome> outcome, double grace) {
  std::thread([grace, outcome] {
    std::this_thread::sleep_for(std::chrono::duration<double>(grace));
    const int64_t cut = outcome->calls_cut();
    if (cut > 0) {
      std::cerr << CutLine(grace, cut) << " (exiting with work still computing)" << std::endl;
    } else {
      std::cerr << "attnserve: shutdown took longer than --shutdown-grace " << grace
                << " s; every call accepted was answered; exiting now" << std::endl;
    }
    std::_Exit(cut > 0 ? 1 : 0);
  }).detach();
}

// 0 when every call accepted was answered and read, 1 when the grace period cut calls in flight or
// answers on their way; said on stdout or stderr.
int ExitCode(const ShutdownOutcome& outcome, double grace) {
  if (const int64_t cut = outcome.calls_cut(); cut > 0) {
    std::cerr << CutLine(grace, cut) << std::endl;
    return 1;
  }
  if (const int64_t unread = outcome.connections_unread.load(); unread > 0) {
    std::cerr << "attnserve: the grace period (--shutdown-grace " << grace << " s) closed "
              << unread << (unread == 1 ? " connection whose client" : " connections whose clients")
              << " had not read everything sent on it (an answer may be cut short: UNAVAILABLE); "
                 "exit 1"
              << std::endl;
    return 1;
  }
  std::cout << "attnserve: stopped" << std::endl;
  return 0;
}

void StopProcess(Server& server, double grace) {
  // Later signals land in the pipe unread: the drain goes on (the grace period still bounds it).
  StartWatchdog(server.shutdown_outcome(), grace);
  server.Shutdown();
  const int code = ExitCode(*server.shutdown_outcome(), grace);
  // The stop is over (every call answered or cut, every connection closed): nothing is left to do
  // but free memory, so the process goes now. Returning would run gRPC 1.51's library clean-up
  // (grpc_shutdown), which joins an executor thread that may be sleeping in the TCP backup poller's
  // 10 s poll (started when a large answer's write had to wait; nothing wakes it once the
  // connections are gone): 3 of 30 busy stops under CPU load were 10 s late
  // (tests/integration/shutdown_test.py --busy-rounds 30).
  std::fflush(nullptr);
  std::_Exit(code);
}

}  // namespace attnserve
