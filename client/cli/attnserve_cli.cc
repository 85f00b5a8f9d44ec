// attnserve-cli: list models, describe one, send an attention request, check health, reload models,
// run a decoding session.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>

#include "attnserve/client.h"
#include "client/cli/client_flags.h"

namespace {

int Fail(const attnserve::CallStatus& s) {
  std::cerr << "attnserve-cli: " << s.ToString() << "\n";
  return 1;
}

std::string Shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void PrintModel(const attnserve::ModelInfo& m) {
  std::printf(
      "%s version %lld: embed_dim=%lld num_heads=%lld kdim=%lld vdim=%lld bias=%d add_bias_kv=%d "
      "add_zero_attn=%d device=%s\n  weights %s from %s\n",
      m.name.c_str(), static_cast<long long>(m.version), static_cast<long long>(m.embed_dim),
      static_cast<long long>(m.num_heads), static_cast<long long>(m.kdim),
      static_cast<long long>(m.vdim), m.bias, m.add_bias_kv, m.add_zero_attn, m.device.c_str(),
      m.weights_hash.c_str(), m.source.c_str());
}

attnserve::Tensor RandomTensor(std::mt19937& rng, std::vector<int64_t> shape, bool half) {
  std::normal_distribution<float> normal;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return half ? attnserve::Tensor::Float16(std::move(shape), v)
              : attnserve::Tensor::Float32(std::move(shape), v);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attnserve-cli: talk to an attnserve server", "attnserve-cli"};
  attnserve::ClientOptions options;
  // The image's HEALTHCHECK runs plain `attnserve-cli health`: ATTNSERVE_TARGET lets a container
  // that serves on another address point it there.
  attnserve::cli::AddClientFlags(app, &options,
                                 "Server address host:port, or replicas: dns:///name:port, "
                                 "ipv4:a:p,b:p (env ATTNSERVE_TARGET)");
  int64_t deadline_ms = 30000;
  app.add_option("--deadline-ms", deadline_ms, "Per-call deadline in ms (0 = none)")
      ->capture_default_str();
  app.require_subcommand(1);

  auto* list = app.add_subcommand("list", "List the served models");
  std::string info_model;
  int64_t info_version = 0;
  auto* info = app.add_subcommand("info", "Describe one model");
  info->add_option("model", info_model, "Model name")->required();
  info->add_option("--version", info_version, "Model version; 0 = the highest")
      ->capture_default_str();
  std::string token_file;
  auto* reload = app.add_subcommand(
      "reload",
      "Ask the server to reload its model repository (AdminService.ReloadModels); exit 0 "
      "only when every model loaded");
  reload->add_option("--admin-token-file", token_file,
                     "File with the server's admin token (sent as 'authorization: Bearer ...'); "
                     "or authenticate with --tls-cert/--tls-key");
  std::string service;
  auto* health = app.add_subcommand("health", "gRPC health check; exit 0 only when SERVING");
  health->add_option("--service", service,
                     "\"\" for the server, or attnserve.v1.AttentionService[/MODEL]");

  auto* attend = app.add_subcommand("attend", "Send one request (random inputs, or a file's)");
  std::string model = "demo", query_file, weights = "none", dtype = "float32";
  int64_t batch = 1, query_len = 16, key_len = 0;
  bool causal = false;
  uint64_t seed = 0;
  int64_t model_version = 0;
  attend->add_option("--model", model, "Model name")->capture_default_str();
  attend->add_option("--model-version", model_version, "Model version; 0 = the highest")
      ->capture_default_str();
  attend->add_option("--batch", batch, "Batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  attend->add_option("--query-len", query_len, "Query length")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  attend->add_option("--key-len", key_len, "Key/value length; 0 = self-attention")
      ->capture_default_str();
  attend->add_option("--query-file", query_file,
                     "Raw little-endian float32 query of shape [batch, query_len, embed_dim] "
                     "(instead of random values)");
  attend->add_option("--weights", weights, "Attention weights to return: none, avg, head")
      ->check(CLI::IsMember({"none", "avg", "head"}))
      ->capture_default_str();
  attend->add_option("--dtype", dtype, "Wire dtype: float32 or float16")
      ->check(CLI::IsMember({"float32", "float16"}))
      ->capture_default_str();
  attend->add_flag("--causal", causal, "Apply a causal mask");
  attend->add_option("--seed", seed, "Seed of the random inputs")->capture_default_str();
  auto* decode = app.add_subcommand(
      "decode",
      "Open a decoding session, send a random prompt then one-token steps, print each "
      "step's round trip, close it");
  std::string decode_model = "demo";
  int64_t decode_batch = 1, prompt_len = 16, decode_steps = 8;
  decode->add_option("--model", decode_model, "Model name")->capture_default_str();
  decode->add_option("--batch", decode_batch, "Sequences")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  decode->add_option("--prompt-len", prompt_len, "Tokens of the first step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  decode->add_option("--steps", decode_steps, "One-token steps after the prompt")
      ->capture_default_str();
  int64_t decode_forks = 0, decode_truncate = 0;
  decode
      ->add_option("--forks", decode_forks,
                   "Then fork the session this many times (ForkSession: beam search, parallel "
                   "sampling) and step each fork once")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  decode
      ->add_option("--truncate", decode_truncate,
                   "Then take back this many tokens (TruncateSession: a rejected draft) and step "
                   "once more")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  attnserve::cli::FinishClientFlags(&options);

  options.deadline = std::chrono::milliseconds(deadline_ms);
  std::unique_ptr<attnserve::Client> made;
  try {
    made = std::make_unique<attnserve::Client>(options);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "attnserve-cli: %s\n", e.what());
    return 2;
  }
  attnserve::Client& client = *made;

  if (*list) {
    std::vector<attnserve::ModelInfo> models;
    auto s = client.ListModels(&models);
    if (!s.ok()) return Fail(s);
    for (const auto& m : models) PrintModel(m);
    return 0;
  }
  if (*decode) {
    attnserve::ModelInfo m;
    auto s = client.GetModel(decode_model, &m);
    if (!s.ok()) return Fail(s);
    attnserve::KvInfo session;
    s = client.OpenSession(decode_model, decode_batch, &session);
    if (!s.ok()) return Fail(s);
    std::printf("session %s on %s version %lld, batch %lld, replica %s\n", session.handle.c_str(),
                session.model.c_str(), static_cast<long long>(session.model_version),
                static_cast<long long>(decode_batch),
                session.replica.empty() ? "(none advertised)" : session.replica.c_str());
    std::mt19937 rng(7);
    attnserve::AttendRequest req;
    req.session = session.handle;
    int64_t held = 0;
    for (int64_t step = 0; step <= decode_steps; ++step) {
      const int64_t tokens = step == 0 ? prompt_len : 1;
      req.query = RandomTensor(rng, {decode_batch, tokens, m.embed_dim}, false);
      req.session_length = held;
      attnserve::AttendResult res;
      const auto t0 = std::chrono::steady_clock::now();
      s = client.Attend(req, &res);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (!s.ok()) {
        client.CloseSession(session.handle);
        return Fail(s);
      }
      held = res.session_length;
      std::printf("step %lld: %lld new token(s), session holds %lld, output %s, %.2f ms\n",
                  static_cast<long long>(step), static_cast<long long>(tokens),
                  static_cast<long long>(held), Shape(res.output.shape).c_str(), ms);
    }
    // Branches: each fork holds the session's tokens and takes its own next token.
    for (int64_t f = 0; f < decode_forks; ++f) {
      attnserve::KvInfo fork;
      auto t0 = std::chrono::steady_clock::now();
      s = client.ForkSession(session.handle, &fork);
      if (!s.ok()) break;
      const double fork_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      attnserve::AttendRequest fr;
      fr.session = fork.handle;
      fr.session_length = fork.length;
      fr.query = RandomTensor(rng, {decode_batch, 1, m.embed_dim}, false);
      attnserve::AttendResult res;
      t0 = std::chrono::steady_clock::now();
      s = client.Attend(fr, &res);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      client.CloseSession(fork.handle);
      if (!s.ok()) break;
      std::printf(
          "fork %lld: %s holds %lld tokens, %lld bytes (%.2f ms); its step: %lld, %.2f ms\n",
          static_cast<long long>(f), fork.handle.c_str(), static_cast<long long>(fork.length),
          static_cast<long long>(fork.bytes), fork_ms, static_cast<long long>(res.session_length),
          ms);
    }
    if (s.ok() && decode_truncate > 0) {
      attnserve::KvInfo after;
      s = client.TruncateSession(session.handle, std::max<int64_t>(0, held - decode_truncate),
                                 &after);
      if (s.ok()) {
        held = after.length;
        req.query = RandomTensor(rng, {decode_batch, 1, m.embed_dim}, false);
        req.session_length = held;
        attnserve::AttendResult res;
        s = client.Attend(req, &res);
        if (s.ok()) {
          std::printf("truncated to %lld tokens; the next step: session holds %lld\n",
                      static_cast<long long>(after.length),
                      static_cast<long long>(res.session_length));
        }
      }
    }
    if (!s.ok()) {
      client.CloseSession(session.handle);
      return Fail(s);
    }
    s = client.CloseSession(session.handle);
    return s.ok() ? 0 : Fail(s);
  }
  if (*info) {
    attnserve::ModelInfo m;
    auto s = client.GetModel(info_model, info_version, &m);
    if (!s.ok()) return Fail(s);
    PrintModel(m);
    return 0;
  }
  if (*reload) {
    attnserve::CallOptions call;
    if (!token_file.empty()) {
      std::ifstream in(token_file);
      std::stringstream text;
      text << in.rdbuf();
      if (!in) {
        std::fprintf(stderr, "attnserve-cli: --admin-token-file %s: cannot read\n",
                     token_file.c_str());
        return 2;
      }
      call.bearer_token = text.str();
      const auto space = " \t\r\n";
      call.bearer_token.erase(0, call.bearer_token.find_first_not_of(space));
      call.bearer_token.erase(call.bearer_token.find_last_not_of(space) + 1);
    }
    attnserve::ReloadResult result;
    auto s = client.ReloadModels(&result, call);
    if (!s.ok()) return Fail(s);
    for (const auto& c : result.changes) {
      std::printf("%s version %lld: %s%s%s\n", c.name.c_str(), static_cast<long long>(c.version),
                  c.action.c_str(),
                  c.weights_hash.empty() ? "" : (" " + c.weights_hash.substr(0, 19)).c_str(),
                  c.message.empty() ? "" : (": " + c.message).c_str());
    }
    std::printf("%d model versions serving%s\n", result.models_served,
                result.changes.empty() ? "; nothing changed" : "");
    return result.any_failed() ? 1 : 0;
  }
  if (*health) {
    bool serving = false;
    auto s = client.Health(service, &serving);
    if (!s.ok()) return Fail(s);
    std::printf("%s\n", serving ? "SERVING" : "NOT_SERVING");
    return serving ? 0 : 1;
  }

  attnserve::ModelInfo m;
  auto s = client.GetModel(model, model_version, &m);
  if (!s.ok()) return Fail(s);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const bool half = dtype == "float16";
  attnserve::AttendRequest req;
  req.model = model;
  req.model_version = model_version;
  if (!query_file.empty()) {
    std::ifstream in(query_file, std::ios::binary);
    std::vector<float> v(static_cast<size_t>(batch * query_len * m.embed_dim));
    if (!in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4))) {
      std::cerr << "attnserve-cli: " << query_file << ": expected " << v.size() * 4
                << " bytes of float32 for [" << batch << ", " << query_len << ", " << m.embed_dim
                << "]\n";
      return 1;
    }
    req.query = half ? attnserve::Tensor::Float16({batch, query_len, m.embed_dim}, v)
                     : attnserve::Tensor::Float32({batch, query_len, m.embed_dim}, v);
  } else {
    req.query = RandomTensor(rng, {batch, query_len, m.embed_dim}, half);
  }
  if (key_len > 0) {
    req.key = RandomTensor(rng, {batch, key_len, m.kdim}, half);
    req.value = RandomTensor(rng, {batch, key_len, m.vdim}, half);
  }
  req.is_causal = causal;
  req.attn_weights = weights == "avg"    ? attnserve::AttnWeights::kAveraged
                     : weights == "head" ? attnserve::AttnWeights::kPerHead
                                         : attnserve::AttnWeights::kNone;
  attnserve::AttendResult r;
  const auto start = std::chrono::steady_clock::now();
  s = client.Attend(req, &r);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) return Fail(s);
  double sum = 0, abs_sum = 0;
  for (float x : r.output.ToFloats()) {
    sum += x;
    abs_sum += std::fabs(x);
  }
  std::printf("model %s version %lld (%s)\nquery %s -> output %s%s\n", r.model.c_str(),
              static_cast<long long>(r.model_version), r.weights_hash.substr(0, 19).c_str(),
              Shape(req.query.shape).c_str(), Shape(r.output.shape).c_str(),
              r.attn_weights ? (", weights " + Shape(r.attn_weights->shape)).c_str() : "");
  std::printf("latency %.3f ms (server: queue %.3f ms, compute %.3f ms)\n", ms,
              r.queue_seconds * 1e3, r.compute_seconds * 1e3);
  std::printf("checksum sum=%.6f abs_sum=%.6f\n", sum, abs_sum);
  return 0;
}
