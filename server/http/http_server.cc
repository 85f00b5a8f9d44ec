#include "server/http/http_server.h"

#include <arpa/inet.h>
#include <gnutls/gnutls.h>
#include <gnutls/x509.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>

#include "server/core/peer.h"

namespace attnserve {

const std::string* HttpRequest::Header(const std::string& name) const {
  for (const auto& [k, v] : headers)
    if (k == name) return &v;
  return nullptr;
}

std::vector<std::string> HttpRequest::Values(const std::string& name) const {
  std::vector<std::string> out;
  for (const auto& [k, v] : headers)
    if (k == name) out.push_back(v);
  return out;
}

// One request from its headers to its answer's last byte.
struct HttpServer::Pending {
  HttpServer* server = nullptr;
  MHD_Connection* connection = nullptr;
  HttpRequest request;
  SteadyClock::time_point headers_at = SteadyClock::now();
  bool refused = false;      // Answered before its body was read (413, 415).
  bool too_large = false;    // A chunked body that passed the bound: 413 once it ends.
  bool over_budget = false;  // Every body's bytes held passed theirs: 503 once it ends.
  int64_t counted = 0;       // Its body's room, counted in HttpServer::body_bytes_.
  bool dispatched = false;   // Handed to the handler: counted in flight until completed.
  std::mutex mu;
  bool suspended = false;      // Suspended now, its answer not yet given.
  bool was_suspended = false;  // Counted in HttpServer::suspended_ until its answer is queued
                               // or its connection ends.
  bool replied = false;        // The handler's answer has come.
  bool orphaned = false;       // Its connection ended first: the answer, when it comes, frees it.
  std::optional<HttpResponse> response;
};

namespace {

// The verified client certificate's names (its common name, then its DNS and email subject
// alternative names); none when the connection has no certificate its CA signed.
std::vector<std::string> CertificateNames(MHD_Connection* c) {
  std::vector<std::string> names;
  const MHD_ConnectionInfo* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_GNUTLS_SESSION);
  if (info == nullptr || info->tls_session == nullptr) return names;
  auto session = static_cast<gnutls_session_t>(info->tls_session);
  unsigned int status = 0;
  if (gnutls_certificate_verify_peers2(session, &status) != GNUTLS_E_SUCCESS || status != 0)
    return names;
  unsigned int count = 0;
  const gnutls_datum_t* chain = gnutls_certificate_get_peers(session, &count);
  if (chain == nullptr || count == 0) return names;
  gnutls_x509_crt_t cert;
  if (gnutls_x509_crt_init(&cert) != GNUTLS_E_SUCCESS) return names;
  if (gnutls_x509_crt_import(cert, &chain[0], GNUTLS_X509_FMT_DER) == GNUTLS_E_SUCCESS) {
    char buf[256];
    size_t size = sizeof(buf);
    if (gnutls_x509_crt_get_dn_by_oid(cert, GNUTLS_OID_X520_COMMON_NAME, 0, 0, buf, &size) ==
        GNUTLS_E_SUCCESS)
      names.emplace_back(buf, size);
    for (unsigned int i = 0; i < 16; ++i) {
      size = sizeof(buf);
      const int kind = gnutls_x509_crt_get_subject_alt_name(cert, i, buf, &size, nullptr);
      if (kind < 0) break;
      if (kind == GNUTLS_SAN_DNSNAME || kind == GNUTLS_SAN_RFC822NAME)
        names.emplace_back(buf, size);
    }
  }
  gnutls_x509_crt_deinit(cert);
  for (std::string& n : names) n.resize(std::strlen(n.c_str()));  // Any terminating NUL counted.
  return names;
}

}  // namespace

// libmicrohttpd's callbacks, with the server's private parts.
struct HttpServerAccess {
  using Pending = HttpServer::Pending;

  static std::string Lower(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s;
  }

  static MHD_Result AddHeader(void* cls, MHD_ValueKind, const char* key, size_t key_size,
                              const char* value, size_t value_size) {
    auto* request = static_cast<HttpRequest*>(cls);
    request->headers.emplace_back(Lower(std::string(key, key_size)),
                                  std::string(value ? value : "", value ? value_size : 0));
    return MHD_YES;
  }

  static MHD_Result Queue(const HttpServer* server, MHD_Connection* c, HttpResponse r) {
    const bool draining = server->draining_.load();
    // The head and the tail's buffers as they are; the holder frees them once sent.
    auto* held = new HttpResponse(std::move(r));
    std::vector<MHD_IoVec> iov;
    iov.push_back({held->head.data(), held->head.size()});
    for (const AnswerBytes& b : held->tail) {
      const char* data = b.block ? b.block.data : b.own ? b.own->data() : nullptr;
      if (b.size() > 0) iov.push_back({data, b.size()});
    }
    MHD_Response* response = MHD_create_response_from_iovec(
        iov.data(), static_cast<unsigned>(iov.size()),
        [](void* p) { delete static_cast<HttpResponse*>(p); }, held);
    if (response == nullptr) {
      delete held;
      return MHD_NO;
    }
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, held->content_type.c_str());
    // From the drain on, each answer closes its connection: keep-alive callers reconnect (to
    // another replica) instead of sending more here.
    if (draining) MHD_add_response_header(response, MHD_HTTP_HEADER_CONNECTION, "close");
    for (const auto& [k, v] : held->headers)
      MHD_add_response_header(response, k.c_str(), v.c_str());
    const MHD_Result queued = MHD_queue_response(c, static_cast<unsigned>(held->code), response);
    MHD_destroy_response(response);
    return queued;
  }

  static HttpResponse Plain(int code, const std::string& message) {
    HttpResponse r;
    r.code = code;
    r.head = "{\"error\":\"" + message + "\"}";  // Messages here carry no quote or backslash.
    return r;
  }

  // The headers are in: a body too large, or one encoded, is refused before a byte is read.
  static std::optional<HttpResponse> Refusal(const HttpServer& server, const HttpRequest& r) {
    // Framing that a proxy in front could read another way (request smuggling) is refused.
    const size_t lengths = r.Values("content-length").size();
    if (lengths > 1) {
      return Plain(400,
                   "Content-Length: given " + std::to_string(lengths) + " times; allowed: once");
    }
    if (lengths == 1 && r.Header("transfer-encoding") != nullptr) {
      return Plain(400,
                   "Content-Length and Transfer-Encoding: both given; allowed: one or the other");
    }
    if (const std::string* length = r.Header("content-length")) {
      char* end = nullptr;
      errno = 0;
      const unsigned long long n = std::strtoull(length->c_str(), &end, 10);
      if (errno != 0 || end == length->c_str() || *end != '\0' ||
          n > static_cast<unsigned long long>(server.options_.max_body_bytes)) {
        return Plain(413, "Content-Length: " + std::string(length->substr(0, 24)) +
                              " bytes; allowed: at most " +
                              std::to_string(server.options_.max_body_bytes) +
                              " (--max-message-bytes)");
      }
    }
    for (const std::string& encoding : r.Values("content-encoding")) {
      if (Lower(encoding) != "identity") {
        return Plain(415,
                     "Content-Encoding: not taken; allowed: identity (send the body as it is)");
      }
    }
    for (const std::string& te : r.Values("transfer-encoding")) {
      if (Lower(te) != "chunked")
        return Plain(501, "Transfer-Encoding: not taken; allowed: chunked");
    }
    for (const auto& [name, value] : r.headers) {
      if (name.find_first_of(" \t") != std::string::npos)
        return Plain(400, "a header name with a space in it; allowed: none (RFC 9112)");
    }
    return std::nullopt;
  }

  static Pending* Begin(HttpServer* server, MHD_Connection* c, const char* url,
                        const char* method) {
    auto* p = new Pending;
    p->server = server;
    p->connection = c;
    p->request.method = method;
    const std::string target = url;
    const size_t q = target.find('?');
    p->request.path = target.substr(0, q);
    if (q != std::string::npos) p->request.query = target.substr(q + 1);
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, &AddHeader, &p->request);
    if (!server->options_.tls_client_ca_pem.empty())
      p->request.certificate_names = CertificateNames(c);
    if (const MHD_ConnectionInfo* info =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS)) {
      p->request.peer = PeerOf(info->client_addr);
      p->request.peer_uri = PeerUriOf(info->client_addr);
      const sockaddr* a = info->client_addr;
      // Loopback: 127/8, ::1, or 127/8 mapped into IPv6 (an IPv4 caller of a "[::]" listener).
      const in6_addr* v6 =
          a->sa_family == AF_INET6 ? &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr : nullptr;
      p->request.local_peer =
          (a->sa_family == AF_INET &&
           (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127) ||
          (v6 != nullptr &&
           (IN6_IS_ADDR_LOOPBACK(v6) || (IN6_IS_ADDR_V4MAPPED(v6) && v6->s6_addr[12] == 127)));
    }
    return p;
  }

  // Room past the body's end that readers may touch (the JSON parser reads ahead in blocks).
  static constexpr size_t kBodyPadding = 64;
  static constexpr size_t kFirstRoom = 64 << 10;

  static MHD_Result Access(void* cls, MHD_Connection* c, const char* url, const char* method,
                           const char*, const char* upload, size_t* upload_size, void** state) {
    auto* server = static_cast<HttpServer*>(cls);
    if (*state == nullptr) {
      InRequest(server, c, true);
      Pending* p = Begin(server, c, url, method);
      *state = p;
      std::optional<HttpResponse> refusal = Refusal(*server, p->request);
      if (!refusal && !server->options_.tls_client_ca_pem.empty() &&
          p->request.certificate_names.empty()) {
        refusal =
            Plain(401, "a client certificate signed by the server's --tls-client-ca is required");
      }
      if (refusal) {
        p->refused = true;
        return Queue(server, c, std::move(*refusal));
      }
      return MHD_YES;
    }
    auto* p = static_cast<Pending*>(*state);
    if (p->refused) {
      *upload_size = 0;  // Its answer is queued: the rest of the body is not kept.
      return MHD_YES;
    }
    if (*upload_size > 0) return Upload(server, p, c, upload, upload_size);
    return Complete(server, p, c);
  }

  static MHD_Result Upload(HttpServer* server, Pending* p, MHD_Connection* c, const char* upload,
                           size_t* upload_size) {
    const size_t n = *upload_size;
    *upload_size = 0;
    const auto timeout = std::chrono::duration_cast<SteadyClock::duration>(
        std::chrono::duration<double>(server->options_.body_timeout_seconds));
    if (SteadyClock::now() - p->headers_at > timeout)
      return MHD_NO;  // A body that trickles: the connection closes.
    if (p->request.body.size() + n > static_cast<size_t>(server->options_.max_body_bytes)) {
      // A chunked body past the bound: nothing more is kept, the rest is read and dropped (within
      // the body timeout), and the answer is 413 once it ends (libmicrohttpd answers only then).
      p->too_large = true;
      p->request.body = std::string();
    }
    if (p->too_large || p->over_budget) return MHD_YES;
    std::string& body = p->request.body;
    if (body.capacity() < body.size() + n + kBodyPadding) {
      // The room a body takes is counted against every body's bound before it is taken, as its
      // bytes arrive: at first its share of the bound (half of it over the connections, at least
      // 64 KiB: every connection's first room together holds at most half the bound, so bodies
      // trickling in cannot starve the others), then doubled, never past its Content-Length. A
      // body within its share (a JSON request of a few hundred KB) is then never copied as its
      // room grows: the copies were 2.3% of the server's CPU under wrk's JSON load.
      const size_t first = std::max<size_t>(
          kFirstRoom, static_cast<size_t>(server->options_.max_body_bytes_held) /
                          (2 * static_cast<size_t>(std::max(1, server->options_.max_connections))));
      size_t want = std::max({body.capacity() * 2, body.size() + n + kBodyPadding, first});
      if (const std::string* length = p->request.Header("content-length")) {
        want = std::min<size_t>(want, std::strtoull(length->c_str(), nullptr, 10) + kBodyPadding);
        want = std::max(want, body.size() + n + kBodyPadding);
      }
      const int64_t more = static_cast<int64_t>(want) - p->counted;
      if (server->body_bytes_.fetch_add(more) + more > server->options_.max_body_bytes_held) {
        server->body_bytes_.fetch_sub(more);
        p->over_budget = true;  // Dropped as it comes; 503 once it ends.
        Release(server, p);
        body = std::string();
        return MHD_YES;
      }
      p->counted += more;
      body.reserve(want);
    }
    body.append(upload, n);
    return MHD_YES;
  }

  // The body's room, given back (dispatched, refused or ended).
  static void Release(HttpServer* server, Pending* p) {
    server->body_bytes_.fetch_sub(p->counted);
    p->counted = 0;
  }

  static MHD_Result Complete(HttpServer* server, Pending* p, MHD_Connection* c) {
    if (p->over_budget) {
      return Queue(server, c,
                   Plain(503, "the server holds its bound of request bodies arriving (" +
                                  std::to_string(server->options_.max_body_bytes_held) +
                                  " bytes, --max-inflight-bytes); retry"));
    }
    if (p->too_large) {
      return Queue(server, c,
                   Plain(413, "the body passed " + std::to_string(server->options_.max_body_bytes) +
                                  " bytes; allowed: at most that (--max-message-bytes)"));
    }
    std::unique_lock<std::mutex> lock(p->mu);
    if (!p->dispatched) {
      {
        // Once the server stops, no request is handed over (and no connection suspended, which
        // would keep libmicrohttpd from stopping): the caller is told to go elsewhere.
        std::lock_guard<std::mutex> count(server->mu_);
        if (server->stopped_) {
          lock.unlock();
          return Queue(server, c, Plain(503, "the server is stopping; retry on another replica"));
        }
        p->dispatched = true;
        ++server->in_flight_;
        ++server->unanswered_;
      }
      lock.unlock();
      HttpReply reply = [p, server](HttpResponse r) {
        {
          std::lock_guard<std::mutex> count(server->mu_);
          if (--server->unanswered_ == 0) server->idle_.notify_all();
        }
        std::unique_lock<std::mutex> l(p->mu);
        if (p->orphaned) {
          l.unlock();
          delete p;
          return;
        }
        p->replied = true;
        p->response = std::move(r);
        if (p->suspended) {
          p->suspended = false;
          MHD_resume_connection(p->connection);
        }
      };
      server->handler_(std::move(p->request), std::move(reply));
      Release(server, p);  // The handler has taken the body (and decoded it).
      lock.lock();
    }
    if (p->response) {
      HttpResponse r = std::move(*p->response);
      p->response.reset();
      if (p->was_suspended) {
        p->was_suspended = false;
        std::lock_guard<std::mutex> count(server->mu_);
        if (--server->suspended_ == 0) server->idle_.notify_all();
      }
      lock.unlock();
      return Queue(server, c, std::move(r));
    }
    {
      std::lock_guard<std::mutex> count(server->mu_);
      ++server->suspended_;
    }
    p->suspended = p->was_suspended = true;
    MHD_suspend_connection(c);
    return MHD_YES;
  }

  // A connection opened or closed: the reaper's table.
  static void Notify(void* cls, MHD_Connection* c, void**, MHD_ConnectionNotificationCode code) {
    auto* server = static_cast<HttpServer*>(cls);
    std::lock_guard<std::mutex> lock(server->conns_mu_);
    const MHD_ConnectionInfo* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    const int fd = info == nullptr ? -1 : info->connect_fd;
    if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
      server->conns_.erase(c);  // Before libmicrohttpd closes its socket.
      if (fd >= 0) ConnectionEnds::Get().Remove(fd);
      return;
    }
    // Its two ends: what finds the process that made its calls (shared memory). Two connections
    // with one client end make neither's calls known (ConnectionEnds::ServerEndOf).
    if (fd >= 0) ConnectionEnds::Get().Add(fd);
    HttpServer::Waiting& w = server->conns_[c];
    w.fd = fd;
    w.since = SteadyClock::now();
  }

  // Its request head is whole (true), or its answer is done (false): the wait for the next starts.
  static void InRequest(HttpServer* server, MHD_Connection* c, bool in_request) {
    std::lock_guard<std::mutex> lock(server->conns_mu_);
    auto it = server->conns_.find(c);
    if (it == server->conns_.end()) return;
    it->second.in_request = in_request;
    it->second.since = SteadyClock::now();
  }

  static void Completed(void* cls, MHD_Connection* c, void** state, MHD_RequestTerminationCode) {
    auto* server = static_cast<HttpServer*>(cls);
    InRequest(server, c, false);
    auto* p = static_cast<Pending*>(*state);
    if (p == nullptr) return;
    Release(server, p);
    *state = nullptr;
    // A connection that ends while suspended (its caller gone) is resumed by the answer, then
    // closed by libmicrohttpd without asking for that answer: it is uncounted here. The answer's
    // resume may still hold `p->mu`; one that has not come yet frees `p` when it does.
    std::unique_lock<std::mutex> lock(p->mu);
    if (p->dispatched) {
      std::lock_guard<std::mutex> count(server->mu_);
      if (--server->in_flight_ == 0) server->idle_.notify_all();
      if (p->was_suspended && --server->suspended_ == 0) server->idle_.notify_all();
    }
    p->was_suspended = false;
    if (p->dispatched && !p->replied) {
      p->orphaned = true;
      return;
    }
    lock.unlock();
    delete p;
  }
};

namespace {

// The request target's %-escapes decoded in place, except those of '/' and NUL, which stay as they
// came: a path segment cannot hide a '/' (a route of its own) or end early at a NUL.
size_t Unescape(void*, MHD_Connection*, char* s) {
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  char* out = s;
  for (const char* in = s; *in != '\0';) {
    const int hi = in[0] == '%' && in[1] != '\0' ? hex(in[1]) : -1;
    const int lo = hi >= 0 && in[2] != '\0' ? hex(in[2]) : -1;
    const int c = hi >= 0 && lo >= 0 ? hi * 16 + lo : -1;
    if (c > 0 && c != '/') {
      *out++ = static_cast<char>(c);
      in += 3;
    } else {
      *out++ = *in++;
    }
  }
  *out = '\0';
  return static_cast<size_t>(out - s);
}

// A listening socket on "host:port" (IPv6 hosts in brackets); the port it got.
StatusOr<int> Listen(const std::string& address, int* port) {
  const auto refuse = [&](const std::string& why) {
    return Status(StatusCode::kFailedPrecondition, "--http-address '" + address + "': " + why);
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return refuse("expected host:port");
  std::string host = address.substr(0, colon);
  const std::string service = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), service.c_str(), &hints,
                  &found) != 0 ||
      found == nullptr)
    return refuse("not an address this host has");
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound =
      fd >= 0 && bind(fd, found->ai_addr, found->ai_addrlen) == 0 && listen(fd, 1024) == 0;
  const int error = errno;
  freeaddrinfo(found);
  if (!bound) {
    if (fd >= 0) close(fd);
    return refuse(std::strerror(error));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  *port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

}  // namespace

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpOptions& options,
                                                        HttpHandler handler) {
  std::unique_ptr<HttpServer> server(new HttpServer());
  server->options_ = options;
  server->handler_ = std::move(handler);
  ASSIGN_OR_RETURN(server->listen_fd_, Listen(options.address, &server->port_));
  const auto idle = static_cast<unsigned>(std::max(1.0, options.idle_timeout_seconds));
  // The options, those of TLS only when it is on.
  std::vector<MHD_OptionItem> items = {
      {MHD_OPTION_LISTEN_SOCKET, server->listen_fd_, nullptr},
      {MHD_OPTION_THREAD_POOL_SIZE, std::max(1, options.threads), nullptr},
      {MHD_OPTION_CONNECTION_LIMIT, std::max(1, options.max_connections), nullptr},
      {MHD_OPTION_PER_IP_CONNECTION_LIMIT, std::max(1, options.max_connections_per_peer), nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT, static_cast<intptr_t>(idle), nullptr},
      {MHD_OPTION_CONNECTION_MEMORY_LIMIT, static_cast<intptr_t>(options.connection_memory_bytes),
       nullptr},
      {MHD_OPTION_NOTIFY_COMPLETED, reinterpret_cast<intptr_t>(&HttpServerAccess::Completed),
       server.get()},
      {MHD_OPTION_UNESCAPE_CALLBACK, reinterpret_cast<intptr_t>(&Unescape), nullptr},
      {MHD_OPTION_NOTIFY_CONNECTION, reinterpret_cast<intptr_t>(&HttpServerAccess::Notify),
       server.get()}};
  unsigned int flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME;
  if (!options.tls_cert_pem.empty()) {
    flags |= MHD_USE_TLS;
    items.push_back(
        {MHD_OPTION_HTTPS_MEM_CERT, 0, const_cast<char*>(options.tls_cert_pem.c_str())});
    items.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0, const_cast<char*>(options.tls_key_pem.c_str())});
    if (!options.tls_client_ca_pem.empty()) {
      items.push_back(
          {MHD_OPTION_HTTPS_MEM_TRUST, 0, const_cast<char*>(options.tls_client_ca_pem.c_str())});
    }
  }
  items.push_back({MHD_OPTION_END, 0, nullptr});
  server->daemon_ = MHD_start_daemon(flags, 0, nullptr, nullptr, &HttpServerAccess::Access,
                                     server.get(), MHD_OPTION_ARRAY, items.data(), MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    close(server->listen_fd_);
    return Status(StatusCode::kFailedPrecondition,
                  "--http-address '" + options.address + "': the HTTP server did not start");
  }
  server->reaper_ = std::thread([s = server.get()] { s->Reap(); });
  return server;
}

void HttpServer::Reap() {
  const auto timeout = std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(options_.idle_timeout_seconds));
  std::unique_lock<std::mutex> lock(conns_mu_);
  while (!reaper_stop_) {
    reaper_cv_.wait_for(lock, std::chrono::milliseconds(250));
    const SteadyClock::time_point now = SteadyClock::now();
    for (auto& [c, w] : conns_) {
      // Its socket is still libmicrohttpd's (the close notification takes this lock first):
      // shut down, the connection sees its end and libmicrohttpd closes it.
      if (!w.in_request && !w.reaped && w.fd >= 0 && now - w.since > timeout) {
        shutdown(w.fd, SHUT_RDWR);
        w.reaped = true;
      }
    }
  }
}

int64_t HttpServer::connections() const {
  if (daemon_ == nullptr) return 0;
  const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
  return info == nullptr ? 0 : static_cast<int64_t>(info->num_connections);
}

int64_t HttpServer::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

void HttpServer::BeginDrain() { draining_.store(true); }

int64_t HttpServer::Stop(SteadyClock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return 0;
    stopped_ = true;
  }
  draining_.store(true);
  // No new connection, and no new request handed over (each is answered 503), from here; the
  // requests handed over are answered and sent first (until `deadline`). One whose answer has not
  // been queued holds its connection suspended, which libmicrohttpd cannot stop with (it aborts):
  // the wait for those has no deadline (the pipeline answers every request it took, and the stop
  // drains it first).
  const MHD_socket listener = MHD_quiesce_daemon(daemon_);
  if (listener != MHD_INVALID_SOCKET) close(listener);
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait_until(lock, deadline, [this] { return in_flight_ == 0; });
  idle_.wait(lock, [this] { return unanswered_ == 0 && suspended_ == 0; });
  const int64_t cut = in_flight_;  // Answers still being sent: their connections close now.
  lock.unlock();
  {
    std::lock_guard<std::mutex> conns(conns_mu_);
    reaper_stop_ = true;
  }
  reaper_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  MHD_stop_daemon(daemon_);
  daemon_ = nullptr;
  return cut;
}

HttpServer::~HttpServer() {
  if (daemon_ != nullptr) Stop(SteadyClock::now());
}

}  // namespace attnserve
