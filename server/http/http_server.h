#pragma once
// An HTTP/1.1 listener (libmicrohttpd underneath: event-driven, so an idle or slow connection holds
// no thread) that hands each whole request to a handler and sends what it answers, from any thread,
// without copying the answer's tensors. Bounded before anything is read: the body by its
// Content-Length (or, chunked, as it arrives), connections in all and per peer address, headers by
// the connection's memory, idle connections and slow bodies by time. Knows nothing of what it
// serves.

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "server/core/deadline.h"
#include "server/core/status.h"
#include "server/core/wire.h"

struct MHD_Daemon;

namespace attnserve {

/// The HTTP port's bounds (docs/flags.md "HTTP").
struct HttpOptions {
  /// host:port to listen on (port 0 picks one); "" serves no HTTP (--http-address).
  std::string address = "127.0.0.1:8000";
  /// Connections open at once; one more is accepted and closed at once (--http-max-connections).
  int max_connections = 256;
  /// Connections from one peer address at once (--http-max-connections-per-peer).
  int max_connections_per_peer = 64;
  /// A connection that sends nothing this long is closed (--http-idle-timeout, seconds); and one
  /// that has not sent a whole request head this long after it opened or after its last answer,
  /// however steadily its bytes trickle in (a header a byte at a time: slowloris).
  double idle_timeout_seconds = 30;
  /// A request body not whole this long after its headers is refused and its connection closed,
  /// however steadily it trickles in (--http-body-timeout, seconds).
  double body_timeout_seconds = 60;
  /// Most bytes of a request's body: a larger Content-Length is refused before a byte of the body
  /// is read (413), a chunked body when it passes it (the server's --max-message-bytes).
  int64_t max_body_bytes = int64_t{64} << 20;
  /// Bytes of request bodies being received, over every connection (each body's room counted as
  /// its bytes arrive: at first its share, half of this over max_connections but at least 64 KiB,
  /// doubled as it fills, never past its Content-Length): a body that would pass it is dropped and
  /// answered 503 (the server's --max-inflight-bytes).
  int64_t max_body_bytes_held = int64_t{1} << 30;
  /// A connection's buffer for a request's line and headers (and its answer's headers): larger
  /// headers are refused (431). libmicrohttpd's default is 32 KiB.
  size_t connection_memory_bytes = 64 << 10;
  /// Threads that serve the connections (each an epoll loop).
  int threads = 2;
  /// TLS (the server's --tls-cert and --tls-key, PEM contents; empty: plaintext). With
  /// `tls_client_ca_pem` (--tls-client-ca), a request must come with a client certificate that CA
  /// signed (401 otherwise), and its names are the request's `certificate_names`.
  std::string tls_cert_pem, tls_key_pem, tls_client_ca_pem;
};

/// A whole request: header names in lower case, in the order they came.
struct HttpRequest {
  std::string method, path, query;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string peer;         ///< The peer's address without its port (PeerOf's form).
  bool local_peer = false;  ///< Loopback.
  std::string peer_uri;     ///< With its port, in gRPC's form (PeerUriOf).
  /// Under mutual TLS, the verified client certificate's common name, then its DNS and email
  /// subject alternative names.
  std::vector<std::string> certificate_names;
  SteadyClock::time_point received = SteadyClock::now();
  /// The first value of header `name` (lower case), or null.
  const std::string* Header(const std::string& name) const;
  /// Every value of header `name` (lower case), in order.
  std::vector<std::string> Values(const std::string& name) const;
};

/// An answer: `head` first, then each of `tail`'s buffers (sent as they are, not copied). `keep`
/// lives until the answer's last byte is sent (or its connection ends).
struct HttpResponse {
  int code = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;
  std::string head;
  std::vector<AnswerBytes> tail;
  std::shared_ptr<void> keep;
};

/// Sends the answer to its request; call exactly once, from any thread.
using HttpReply = std::function<void(HttpResponse)>;
/// Decides the answer to a whole request: calls `reply` once, now or later, on any thread.
using HttpHandler = std::function<void(HttpRequest&&, HttpReply)>;

class HttpServer {
 public:
  /// Listens on `options.address` and serves `handler`. FAILED_PRECONDITION naming
  /// --http-address when it cannot listen.
  static StatusOr<std::unique_ptr<HttpServer>> Start(const HttpOptions& options,
                                                     HttpHandler handler);
  /// Stop(now) unless stopped.
  ~HttpServer();
  int port() const { return port_; }
  /// The drain began: every answer from now on closes its connection (Connection: close), so
  /// keep-alive callers reconnect elsewhere; requests are still served.
  void BeginDrain();
  /// Stops accepting connections and handing requests over (one arriving on an open connection
  /// is answered 503), waits until every request already handed to the handler is answered and
  /// sent (or `deadline`), then closes every connection. Returns the answers still being sent at
  /// the deadline (cut short). Idempotent (0 after the first).
  int64_t Stop(SteadyClock::time_point deadline);
  /// Requests handed to the handler and not yet sent.
  int64_t in_flight() const;
  /// Connections open now, and the room the bodies being received take (counted against
  /// HttpOptions::max_body_bytes_held): for the metrics.
  int64_t connections() const;
  int64_t body_bytes() const { return body_bytes_.load(); }

  struct Pending;  // One request on its way: libmicrohttpd's per-request state.

 private:
  HttpServer() = default;
  friend struct HttpServerAccess;
  HttpOptions options_;
  HttpHandler handler_;
  MHD_Daemon* daemon_ = nullptr;
  int listen_fd_ = -1;
  int port_ = 0;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  int64_t in_flight_ = 0;   // Handed to the handler, not yet sent.
  int64_t unanswered_ = 0;  // Handed to the handler, not yet answered.
  int64_t suspended_ = 0;   // Connections suspended, their answers not yet queued.
  // Each connection's socket and since when it has waited for a request head (none while a
  // request is being read or answered): the reaper closes those past the idle timeout.
  struct Waiting {
    int fd = -1;
    SteadyClock::time_point since;
    bool in_request = false;
    bool reaped = false;
  };
  std::mutex conns_mu_;
  std::map<const void*, Waiting> conns_;
  std::condition_variable reaper_cv_;
  bool reaper_stop_ = false;  // Under conns_mu_.
  std::thread reaper_;
  void Reap();  // The reaper's loop (on reaper_).
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> body_bytes_{0};  // Bodies' room, being received (max_body_bytes_held).
  bool stopped_ = false;
};

}  // namespace attnserve
