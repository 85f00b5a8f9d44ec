#pragma once
// The connection flags attnserve-cli and attnserve-bench share: target (one server or several
// replicas), TLS and mutual TLS. Not public API.

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "attnserve/client.h"

namespace attnserve::cli {

/// Adds --target, --tls, --tls-ca, --tls-cert, --tls-key, --tls-server-name, --proxy and
/// --no-balancing to `app`, writing into `options`. ATTNSERVE_TARGET, when set, is the target's
/// default.
inline void AddClientFlags(CLI::App& app, ClientOptions* options, const char* target_help) {
  if (const char* env = std::getenv("ATTNSERVE_TARGET")) options->target = env;
  app.add_option("--target", options->target, target_help)->capture_default_str();
  app.add_flag("--tls", options->tls.enabled,
               "Connect with TLS (implied by the other --tls-* flags)");
  app.add_option(
      "--tls-ca", options->tls.root_certs_file,
      "PEM CA certificate(s) that signed the server's certificate (default: system roots)");
  app.add_option("--tls-cert", options->tls.cert_file,
                 "PEM client certificate chain, for mutual TLS");
  app.add_option("--tls-key", options->tls.key_file, "PEM client private key, for mutual TLS");
  app.add_option("--tls-server-name", options->tls.server_name,
                 "Name to check in the server certificate instead of the target's host");
  app.add_flag_callback(
      "--proxy",
      [options] {
        options->service_config = kProxyServiceConfig;
        options->route_to_replica = false;
      },
      "The target is a proxy in front of the replicas (nginx, Envoy): retries of UNAVAILABLE and "
      "CANCELLED without client-side health checking; sessions and memories reach their replica "
      "through the proxy, which routes by the replica their calls name (attnserve-replica)");
  app.add_flag_callback(
      "--no-balancing", [options] { options->service_config.clear(); },
      "gRPC's defaults (pick_first, no retries) instead of round_robin over every address of the "
      "target with retries of UNAVAILABLE and CANCELLED");
  app.add_flag_callback(
      "--float32-wire", [options] { options->wire_dtype = ClientOptions::WireDtype::kAsGiven; },
      "Send float32 tensors as float32 even to a bfloat16 or float16 model (default: they travel "
      "in the model's dtype, half the bytes, and answers are widened back)");
  app.add_option("--connections", options->connections,
                 "Connections the client spreads its calls over")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option_function<std::vector<std::string>>(
      "--grpc-arg",
      [options](const std::vector<std::string>& args) {
        for (const std::string& a : args) {
          const size_t eq = a.find('=');
          size_t used = 0;
          int value = 0;
          try {
            if (eq != std::string::npos && eq > 0) value = std::stoi(a.substr(eq + 1), &used);
          } catch (const std::exception&) {
            used = 0;
          }
          if (used == 0 || eq + 1 + used != a.size())
            throw CLI::ValidationError("--grpc-arg", a + ": expected NAME=INTEGER (an int)");
          options->channel_args[a.substr(0, eq)] = value;
        }
      },
      "A gRPC channel argument, NAME=INTEGER (repeatable), over the client's own: e.g. "
      "grpc.http2.lookahead_bytes=4194304");
}

/// After parsing: any --tls-* flag turns TLS on.
inline void FinishClientFlags(ClientOptions* options) {
  const TlsOptions& t = options->tls;
  if (!t.root_certs_file.empty() || !t.cert_file.empty() || !t.key_file.empty() ||
      !t.server_name.empty()) {
    options->tls.enabled = true;
  }
}

}  // namespace attnserve::cli
