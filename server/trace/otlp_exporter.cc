#include "server/trace/otlp_exporter.h"

#include <iostream>

#include "otlp/trace_export.grpc.pb.h"
#include "server/core/files.h"

namespace attnserve {
namespace otlp = opentelemetry::proto::collector::trace::v1;
namespace {

std::string Bytes(const uint8_t* p, size_t n) {
  return std::string(reinterpret_cast<const char*>(p), n);
}

void ToWire(const SpanAttribute& a, otlp::KeyValue* kv) {
  kv->set_key(a.key);
  otlp::AnyValue* v = kv->mutable_value();
  if (const auto* s = std::get_if<std::string>(&a.value)) v->set_string_value(*s);
  if (const auto* i = std::get_if<int64_t>(&a.value)) v->set_int_value(*i);
  if (const auto* d = std::get_if<double>(&a.value)) v->set_double_value(*d);
  if (const auto* b = std::get_if<bool>(&a.value)) v->set_bool_value(*b);
}

void ToWire(const SpanData& s, otlp::Span* out) {
  out->set_trace_id(Bytes(s.trace_id.data(), s.trace_id.size()));
  out->set_span_id(Bytes(s.span_id.data(), s.span_id.size()));
  if (!IsZero(s.parent_span_id.data(), s.parent_span_id.size()))
    out->set_parent_span_id(Bytes(s.parent_span_id.data(), s.parent_span_id.size()));
  out->set_trace_state(s.tracestate);
  // Sampled (bit 0); whether the parent is remote is known (bit 8): a server span's parent is
  // its caller's, in another process (bit 9); every other span's parent is attnserve's own.
  const bool remote_parent = s.kind == SpanKind::kServer && !IsZero(s.parent_span_id.data(), 8);
  out->set_flags(remote_parent ? 0x301 : 0x101);
  out->set_name(s.name);
  out->set_kind(s.kind == SpanKind::kServer ? otlp::Span::SPAN_KIND_SERVER
                                            : otlp::Span::SPAN_KIND_INTERNAL);
  out->set_start_time_unix_nano(static_cast<uint64_t>(s.start_unix_nanos));
  out->set_end_time_unix_nano(static_cast<uint64_t>(s.end_unix_nanos));
  for (const SpanAttribute& a : s.attributes) ToWire(a, out->add_attributes());
  for (const SpanLink& l : s.links) {
    otlp::Span::Link* link = out->add_links();
    link->set_trace_id(Bytes(l.trace_id.data(), l.trace_id.size()));
    link->set_span_id(Bytes(l.span_id.data(), l.span_id.size()));
    link->set_flags(0x101);
  }
  if (s.error) {
    out->mutable_status()->set_code(otlp::Status::STATUS_CODE_ERROR);
    out->mutable_status()->set_message(s.error_message);
  }
}

// The file a TLS flag names, read; FAILED_PRECONDITION naming the flag.
Status ReadPem(const std::string& path, const char* flag, std::string* out) {
  if (path.empty()) return Status::Ok();
  StatusOr<std::string> text = ReadFile(path, uint64_t{1} << 20);
  if (!text.ok()) {
    return Status(StatusCode::kFailedPrecondition,
                  std::string(flag) + " " + path + ": " + text.status().message());
  }
  *out = *std::move(text);
  return Status::Ok();
}

}  // namespace

Status ExporterOptions::Validate() const {
  const auto fail = [](const std::string& m) { return Status(StatusCode::kFailedPrecondition, m); };
  if (endpoint.empty())
    return fail("--trace-endpoint: empty; expected host:port of an OTLP/gRPC collector");
  if (!tls && !(tls_ca_file.empty() && tls_cert_file.empty() && tls_key_file.empty()))
    return fail(
        "--trace-tls-ca, --trace-tls-cert, --trace-tls-key: given without TLS to the collector (an "
        "https:// endpoint or --trace-tls)");
  if (tls_cert_file.empty() != tls_key_file.empty())
    return fail("--trace-tls-cert and --trace-tls-key: give both (mutual TLS) or neither");
  if (max_queue_spans < 1 || max_batch_spans < 1)
    return fail("trace exporter: the queue and the batch must hold at least one span");
  return Status::Ok();
}

StatusOr<std::unique_ptr<OtlpExporter>> OtlpExporter::Start(ExporterOptions options) {
  RETURN_IF_ERROR(options.Validate());
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    RETURN_IF_ERROR(ReadPem(options.tls_ca_file, "--trace-tls-ca", &ssl.pem_root_certs));
    RETURN_IF_ERROR(ReadPem(options.tls_cert_file, "--trace-tls-cert", &ssl.pem_cert_chain));
    RETURN_IF_ERROR(ReadPem(options.tls_key_file, "--trace-tls-key", &ssl.pem_private_key));
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  // A collector that went away is tried again soon, not after gRPC's backoff grew to two minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  auto channel = grpc::CreateCustomChannel(options.endpoint, creds, args);
  return std::unique_ptr<OtlpExporter>(new OtlpExporter(std::move(options), std::move(channel)));
}

OtlpExporter::OtlpExporter(ExporterOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)), channel_(std::move(channel)) {
  thread_ = std::thread([this] { Loop(); });
}

OtlpExporter::~OtlpExporter() { Shutdown(); }

void OtlpExporter::Export(SpanData span) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_ && queue_.size() < options_.max_queue_spans) {
      queue_.push_back(std::move(span));
      if (queue_.size() >= options_.max_batch_spans) cv_.notify_one();
      return;
    }
  }
  Dropped(1, "queue_full");
}

void OtlpExporter::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void OtlpExporter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait_for(lock, options_.interval,
                 [this] { return stopping_ || queue_.size() >= options_.max_batch_spans; });
    const bool last = stopping_;
    while (!queue_.empty()) {
      const size_t n = std::min(queue_.size(), options_.max_batch_spans);
      std::vector<SpanData> batch(std::make_move_iterator(queue_.begin()),
                                  std::make_move_iterator(queue_.begin() + n));
      queue_.erase(queue_.begin(), queue_.begin() + n);
      lock.unlock();
      const bool sent = Send(std::move(batch));
      lock.lock();
      if (!sent && last) {
        // Stopping while the collector fails: one try is enough. The rest is dropped (counted)
        // rather than each batch waiting out a timeout of its own.
        const int64_t rest = static_cast<int64_t>(queue_.size());
        queue_.clear();
        lock.unlock();
        Dropped(rest, "export_failed");
        lock.lock();
        break;
      }
      if (!sent) break;  // The rest waits for the next round (or the queue drops).
      if (!last && queue_.size() < options_.max_batch_spans) break;
    }
    if (last) return;
  }
}

bool OtlpExporter::Send(std::vector<SpanData> batch) {
  otlp::ExportTraceServiceRequest req;
  otlp::ResourceSpans* rs = req.add_resource_spans();
  for (const SpanAttribute& a : options_.resource)
    ToWire(a, rs->mutable_resource()->add_attributes());
  otlp::ScopeSpans* scope = rs->add_scope_spans();
  scope->mutable_scope()->set_name("attnserve");
  for (const SpanData& s : batch) ToWire(s, scope->add_spans());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.timeout);
  otlp::ExportTraceServiceResponse resp;
  const grpc::Status st = otlp::TraceService::NewStub(channel_)->Export(&ctx, req, &resp);
  const int64_t n = static_cast<int64_t>(batch.size());
  if (st.ok()) {
    const int64_t rejected = std::min(n, resp.partial_success().rejected_spans());
    exported_ += n - rejected;
    if (options_.on_exported) options_.on_exported(n - rejected);
    if (rejected > 0) Dropped(rejected, "rejected");
    if (failing_) {
      failing_ = false;
      std::cerr << "attnserve: trace export to " << options_.endpoint << " works again\n";
    }
    return true;
  }
  Dropped(n, "export_failed");
  if (!failing_) {
    failing_ = true;
    std::cerr << "attnserve: trace export to " << options_.endpoint << " failed ("
              << st.error_message() << "); spans are dropped while it fails, counted in "
              << "attnserve_trace_spans_dropped_total; said once until it works again\n";
  }
  return false;
}

void OtlpExporter::Dropped(int64_t n, const char* reason) {
  dropped_ += n;
  if (options_.on_dropped) options_.on_dropped(n, reason);
}

}  // namespace attnserve
