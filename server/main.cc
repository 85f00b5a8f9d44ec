// attnserve: serves multi-head attention over gRPC. `attnserve --help` lists the flags.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <thread>

#include "server/server.h"

int main(int argc, char** argv) {
  attnserve::ServerOptions o;
  CLI::App app{
      "attnserve: multi-head attention inference over gRPC, computed exactly as PyTorch's\n"
      "nn.MultiheadAttention. With no --models it serves the built-in `demo` model\n"
      "(embed_dim 512, 8 heads). Stops gracefully on SIGINT/SIGTERM.",
      "attnserve"};
  app.add_option("--address", o.address, "gRPC listen address (host:port; port 0 picks one)")
      ->capture_default_str();
  app.add_option("--metrics-address", o.metrics_address,
                 "Prometheus /metrics listen address; empty to disable")
      ->capture_default_str();
  app.add_option("--models", o.models_dir,
                 "Directory of models: one subdirectory per model with config.json and weights "
                 "(README \"Models\"); default: the built-in demo model");
  app.add_option("--device", o.device, "Compute device: cpu, cuda or cuda:N")->capture_default_str();
  o.workers = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--workers", o.workers, "Compute threads (default: one per core)")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--max-queue-size", o.max_queue_size,
                 "Requests that may wait for compute; beyond it new ones get RESOURCE_EXHAUSTED")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-message-bytes", o.max_message_bytes,
                 "Largest gRPC message received or sent, in bytes")
      ->check(CLI::Range(1 << 20, 1 << 30))
      ->capture_default_str();
  app.add_option("--max-request-tokens", o.limits.max_tokens,
                 "Most tokens in one request: batch * (query_len + key_len)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-attention-scores", o.limits.max_attention_scores,
                 "Most attention scores in one request: batch * heads * query_len * key_len")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--shutdown-grace", o.shutdown_grace_seconds,
                 "Seconds in-flight requests get to finish on SIGINT/SIGTERM")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  // Every thread started from here on inherits the blocked signals; this one waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = attnserve::Server::Start(o);
  if (!server.ok()) {
    std::cerr << "attnserve: error: " << server.status().message() << "\n";
    return 2;
  }
  std::cout << (*server)->Describe() << std::endl;
  int sig = 0;
  sigwait(&signals, &sig);
  std::cout << "attnserve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM")
            << ": draining in-flight requests" << std::endl;
  (*server)->Shutdown();
  std::cout << "attnserve: stopped" << std::endl;
  return 0;
}
