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
  if (!s.trace_id.empty()) std::cerr << "attnserve-cli: the server's trace: " << s.trace_id << "\n";
  return 1;
}

// A new sampled W3C traceparent: "00-<32 hex>-<16 hex>-01" from the OS's random numbers.
std::string NewTraceparent() {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  const auto hex = [&](int n) {
    std::string out;
    while (static_cast<int>(out.size()) < n) out += kHex[rd() & 15];
    return out;
  };
  std::string trace = hex(32), span = hex(16);
  if (trace.find_first_not_of('0') == std::string::npos) trace[31] = '1';
  if (span.find_first_not_of('0') == std::string::npos) span[15] = '1';
  return "00-" + trace + "-" + span + "-01";
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

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One subcommand: its flags (declared by the constructor) and what it does with a client.
class Command {
 public:
  virtual ~Command() = default;
  bool chosen() const { return sub_ != nullptr && sub_->parsed(); }
  virtual int Run(attnserve::Client& client) = 0;

 protected:
  CLI::App* sub_ = nullptr;
};

class ListCommand final : public Command {
 public:
  explicit ListCommand(CLI::App& app) {
    sub_ = app.add_subcommand("list", "List the served models");
  }
  int Run(attnserve::Client& client) override {
    std::vector<attnserve::ModelInfo> models;
    auto s = client.ListModels(&models);
    if (!s.ok()) return Fail(s);
    for (const auto& m : models) PrintModel(m);
    return 0;
  }
};

class InfoCommand final : public Command {
 public:
  explicit InfoCommand(CLI::App& app) {
    sub_ = app.add_subcommand("info", "Describe one model");
    sub_->add_option("model", model_, "Model name")->required();
    sub_->add_option("--version", version_, "Model version; 0 = the highest")
        ->capture_default_str();
  }
  int Run(attnserve::Client& client) override {
    attnserve::ModelInfo m;
    auto s = client.GetModel(model_, version_, &m);
    if (!s.ok()) return Fail(s);
    PrintModel(m);
    return 0;
  }

 private:
  std::string model_;
  int64_t version_ = 0;
};

class ReloadCommand final : public Command {
 public:
  explicit ReloadCommand(CLI::App& app) {
    sub_ = app.add_subcommand(
        "reload",
        "Ask the server to reload its model repository (AdminService.ReloadModels); exit 0 "
        "only when every model loaded");
    sub_->add_option("--admin-token-file", token_file_,
                     "File with the server's admin token (sent as 'authorization: Bearer ...'); "
                     "or authenticate with --tls-cert/--tls-key");
  }
  int Run(attnserve::Client& client) override {
    attnserve::CallOptions call;
    if (!token_file_.empty() && !ReadToken(&call.bearer_token)) return 2;
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

 private:
  // The token file's text without surrounding white space; false (said on stderr) when unreadable.
  bool ReadToken(std::string* token) const {
    std::ifstream in(token_file_);
    std::stringstream text;
    text << in.rdbuf();
    if (!in) {
      std::fprintf(stderr, "attnserve-cli: --admin-token-file %s: cannot read\n",
                   token_file_.c_str());
      return false;
    }
    *token = text.str();
    const auto space = " \t\r\n";
    token->erase(0, token->find_first_not_of(space));
    token->erase(token->find_last_not_of(space) + 1);
    return true;
  }
  std::string token_file_;
};

class HealthCommand final : public Command {
 public:
  explicit HealthCommand(CLI::App& app) {
    sub_ = app.add_subcommand("health", "gRPC health check; exit 0 only when SERVING");
    sub_->add_option("--service", service_,
                     "\"\" for the server, or attnserve.v1.AttentionService[/MODEL]");
  }
  int Run(attnserve::Client& client) override {
    bool serving = false;
    auto s = client.Health(service_, &serving);
    if (!s.ok()) return Fail(s);
    std::printf("%s\n", serving ? "SERVING" : "NOT_SERVING");
    return serving ? 0 : 1;
  }

 private:
  std::string service_;
};

class AttendCommand final : public Command {
 public:
  explicit AttendCommand(CLI::App& app) {
    sub_ = app.add_subcommand("attend", "Send one request (random inputs, or a file's)");
    sub_->add_option("--model", model_, "Model name")->capture_default_str();
    sub_->add_option("--model-version", model_version_, "Model version; 0 = the highest")
        ->capture_default_str();
    sub_->add_option("--batch", batch_, "Batch size")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    sub_->add_option("--query-len", query_len_, "Query length")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    sub_->add_option("--key-len", key_len_, "Key/value length; 0 = self-attention")
        ->capture_default_str();
    sub_->add_option("--query-file", query_file_,
                     "Raw little-endian float32 query of shape [batch, query_len, embed_dim] "
                     "(instead of random values)");
    sub_->add_option("--weights", weights_, "Attention weights to return: none, avg, head")
        ->check(CLI::IsMember({"none", "avg", "head"}))
        ->capture_default_str();
    sub_->add_option("--dtype", dtype_, "Wire dtype: float32 or float16")
        ->check(CLI::IsMember({"float32", "float16"}))
        ->capture_default_str();
    sub_->add_flag("--causal", causal_, "Apply a causal mask");
    sub_->add_option("--seed", seed_, "Seed of the random inputs")->capture_default_str();
    sub_->add_option("--traceparent", traceparent_,
                     "W3C traceparent to send: the server's spans join that trace");
    sub_->add_flag("--trace", trace_,
                   "Start a new sampled trace for the call and print its trace id (the server "
                   "exports its spans when it has --trace-endpoint)");
    sub_->add_option("--priority", priority_,
                     "Priority level where the model has levels: 1 first; 0 = the default")
        ->capture_default_str();
    sub_->add_option("--tenant", tenant_,
                     "Send the call as this tenant, in the --tenant-header metadata (honoured only "
                     "by a server started with that --tenant-header, behind a gateway)");
    sub_->add_option("--tenant-header", tenant_header_, "The metadata key --tenant goes in")
        ->capture_default_str();
    query_position_flag_ = sub_->add_option(
        "--query-position", query_position_,
        "Models from a decoder checkpoint: the first query token's position (RoPE)");
    sub_->add_option("--key-position", key_position_,
                     "Models from a decoder checkpoint, with --key-len: the first key's position")
        ->capture_default_str();
  }
  int Run(attnserve::Client& client) override {
    attnserve::ModelInfo m;
    auto s = client.GetModel(model_, model_version_, &m);
    if (!s.ok()) return Fail(s);
    attnserve::AttendRequest req;
    if (!Prepare(m, &req)) return 1;
    req.priority = priority_;
    attnserve::CallOptions call;
    if (!tenant_.empty()) call.metadata.emplace_back(tenant_header_, tenant_);
    call.traceparent = trace_ && traceparent_.empty() ? NewTraceparent() : traceparent_;
    if (!call.traceparent.empty() && call.traceparent.size() >= 35) {
      std::printf("trace %s\n", call.traceparent.substr(3, 32).c_str());
    }
    attnserve::AttendResult r;
    const auto start = std::chrono::steady_clock::now();
    s = client.Attend(req, &r, call);
    const double ms = MsSince(start);
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

 private:
  // The request from the flags: random inputs, or the query file's; false (said) when unreadable.
  bool Prepare(const attnserve::ModelInfo& m, attnserve::AttendRequest* req) const {
    std::mt19937 rng(static_cast<uint32_t>(seed_));
    const bool half = dtype_ == "float16";
    req->model = model_;
    req->model_version = model_version_;
    if (!query_file_.empty()) {
      std::ifstream in(query_file_, std::ios::binary);
      std::vector<float> v(static_cast<size_t>(batch_ * query_len_ * m.embed_dim));
      if (!in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4))) {
        std::cerr << "attnserve-cli: " << query_file_ << ": expected " << v.size() * 4
                  << " bytes of float32 for [" << batch_ << ", " << query_len_ << ", "
                  << m.embed_dim << "]\n";
        return false;
      }
      req->query = half ? attnserve::Tensor::Float16({batch_, query_len_, m.embed_dim}, v)
                        : attnserve::Tensor::Float32({batch_, query_len_, m.embed_dim}, v);
    } else {
      req->query = RandomTensor(rng, {batch_, query_len_, m.embed_dim}, half);
    }
    if (key_len_ > 0) {
      req->key = RandomTensor(rng, {batch_, key_len_, m.kdim}, half);
      req->value = RandomTensor(rng, {batch_, key_len_, m.vdim}, half);
    }
    req->is_causal = causal_;
    if (query_position_flag_->count() > 0) req->query_position = query_position_;
    req->key_position = key_position_;
    req->attn_weights = weights_ == "avg"    ? attnserve::AttnWeights::kAveraged
                        : weights_ == "head" ? attnserve::AttnWeights::kPerHead
                                             : attnserve::AttnWeights::kNone;
    return true;
  }
  std::string model_ = "demo", query_file_, weights_ = "none", dtype_ = "float32", traceparent_;
  std::string tenant_, tenant_header_ = "attnserve-tenant";
  uint64_t priority_ = 0;
  int64_t batch_ = 1, query_len_ = 16, key_len_ = 0, model_version_ = 0, key_position_ = 0;
  int64_t query_position_ = 0;
  CLI::Option* query_position_flag_ = nullptr;
  bool causal_ = false, trace_ = false;
  uint64_t seed_ = 0;
};

class DecodeCommand final : public Command {
 public:
  explicit DecodeCommand(CLI::App& app) {
    sub_ = app.add_subcommand(
        "decode",
        "Open a decoding session, send a random prompt then one-token steps, print each "
        "step's round trip, close it");
    sub_->add_option("--model", model_, "Model name")->capture_default_str();
    sub_->add_option("--batch", batch_, "Sequences")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    sub_->add_option("--prompt-len", prompt_len_, "Tokens of the first step")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    sub_->add_option("--steps", steps_, "One-token steps after the prompt")->capture_default_str();
    sub_->add_option("--forks", forks_,
                     "Then fork the session this many times (ForkSession: beam search, parallel "
                     "sampling) and step each fork once")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    sub_->add_option("--sessions", sessions_,
                     "Sessions decoded together: with more than one, every step of all of them "
                     "goes in one batched call (AttendRequest.steps)")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    sub_->add_option("--truncate", truncate_,
                     "Then take back this many tokens (TruncateSession: a rejected draft) and "
                     "step once more")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
  }
  int Run(attnserve::Client& client) override {
    auto s = client.GetModel(model_, &model_info_);
    if (!s.ok()) return Fail(s);
    if (sessions_ > 1) return Together(client);
    attnserve::KvInfo session;
    s = client.OpenSession(model_, batch_, &session);
    if (!s.ok()) return Fail(s);
    std::printf("session %s on %s version %lld, batch %lld, replica %s\n", session.handle.c_str(),
                session.model.c_str(), static_cast<long long>(session.model_version),
                static_cast<long long>(batch_),
                session.replica.empty() ? "(none advertised)" : session.replica.c_str());
    int64_t held = 0;
    s = Steps(client, session.handle, &held);
    if (s.ok()) s = Forks(client, session.handle);
    if (s.ok() && truncate_ > 0) s = Truncate(client, session.handle, &held);
    const auto closed = client.CloseSession(session.handle);
    if (!s.ok()) return Fail(s);
    return closed.ok() ? 0 : Fail(closed);
  }

 private:
  attnserve::Tensor Tokens(int64_t n) {
    return RandomTensor(rng_, {batch_, n, model_info_.embed_dim}, false);
  }
  // The prompt, then one-token steps; *held: the tokens the session holds after them.
  attnserve::CallStatus Steps(attnserve::Client& client, const std::string& handle, int64_t* held) {
    attnserve::AttendRequest req;
    req.session = handle;
    for (int64_t step = 0; step <= steps_; ++step) {
      const int64_t tokens = step == 0 ? prompt_len_ : 1;
      req.query = Tokens(tokens);
      req.session_length = *held;
      attnserve::AttendResult res;
      const auto t0 = std::chrono::steady_clock::now();
      auto s = client.Attend(req, &res);
      if (!s.ok()) return s;
      *held = res.session_length;
      std::printf("step %lld: %lld new token(s), session holds %lld, output %s, %.2f ms\n",
                  static_cast<long long>(step), static_cast<long long>(tokens),
                  static_cast<long long>(*held), Shape(res.output.shape).c_str(), MsSince(t0));
    }
    return {};
  }
  // --sessions N: N sessions, each step of all of them in one batched call.
  int Together(attnserve::Client& client) {
    std::vector<attnserve::KvInfo> sessions(static_cast<size_t>(sessions_));
    attnserve::CallStatus s;
    for (auto& session : sessions) {
      if (s.ok()) s = client.OpenSession(model_, batch_, &session);
    }
    std::vector<int64_t> held(sessions.size(), 0);
    for (int64_t step = 0; s.ok() && step <= steps_; ++step) {
      const int64_t tokens = step == 0 ? prompt_len_ : 1;
      attnserve::AttendRequest req;
      for (size_t i = 0; i < sessions.size(); ++i) {
        attnserve::Step entry;
        entry.session = sessions[i].handle;
        entry.session_length = held[i];
        entry.query = Tokens(tokens);
        req.steps.push_back(std::move(entry));
      }
      attnserve::AttendResult res;
      const auto t0 = std::chrono::steady_clock::now();
      s = client.Attend(req, &res);
      if (!s.ok()) break;
      for (size_t i = 0; i < res.steps.size(); ++i) {
        if (!res.steps[i].status.ok()) {
          s.code = res.steps[i].status.code;
          s.message = res.steps[i].status.message;
          break;
        }
        held[i] = res.steps[i].session_length;
      }
      if (!s.ok()) break;
      std::printf(
          "step %lld: %lld sessions, %lld new token(s) each, in one call: %.2f ms (server: "
          "queue %.3f ms, compute %.3f ms)\n",
          static_cast<long long>(step), static_cast<long long>(sessions_),
          static_cast<long long>(tokens), MsSince(t0), res.queue_seconds * 1e3,
          res.compute_seconds * 1e3);
    }
    for (const auto& session : sessions) {
      if (!session.handle.empty()) client.CloseSession(session.handle);
    }
    return s.ok() ? 0 : Fail(s);
  }
  // Branches: each fork holds the session's tokens and takes its own next token.
  attnserve::CallStatus Forks(attnserve::Client& client, const std::string& handle) {
    for (int64_t f = 0; f < forks_; ++f) {
      attnserve::KvInfo fork;
      auto t0 = std::chrono::steady_clock::now();
      auto s = client.ForkSession(handle, &fork);
      if (!s.ok()) return s;
      const double fork_ms = MsSince(t0);
      attnserve::AttendRequest fr;
      fr.session = fork.handle;
      fr.session_length = fork.length;
      fr.query = Tokens(1);
      attnserve::AttendResult res;
      t0 = std::chrono::steady_clock::now();
      s = client.Attend(fr, &res);
      const double ms = MsSince(t0);
      client.CloseSession(fork.handle);
      if (!s.ok()) return s;
      std::printf(
          "fork %lld: %s holds %lld tokens, %lld bytes (%.2f ms); its step: %lld, %.2f ms\n",
          static_cast<long long>(f), fork.handle.c_str(), static_cast<long long>(fork.length),
          static_cast<long long>(fork.bytes), fork_ms, static_cast<long long>(res.session_length),
          ms);
    }
    return {};
  }
  // A rejected draft: the last tokens taken back, then one more step.
  attnserve::CallStatus Truncate(attnserve::Client& client, const std::string& handle,
                                 int64_t* held) {
    attnserve::KvInfo after;
    auto s = client.TruncateSession(handle, std::max<int64_t>(0, *held - truncate_), &after);
    if (!s.ok()) return s;
    *held = after.length;
    attnserve::AttendRequest req;
    req.session = handle;
    req.query = Tokens(1);
    req.session_length = *held;
    attnserve::AttendResult res;
    s = client.Attend(req, &res);
    if (s.ok()) {
      std::printf("truncated to %lld tokens; the next step: session holds %lld\n",
                  static_cast<long long>(after.length), static_cast<long long>(res.session_length));
    }
    return s;
  }
  std::string model_ = "demo";
  int64_t batch_ = 1, prompt_len_ = 16, steps_ = 8, forks_ = 0, truncate_ = 0, sessions_ = 1;
  attnserve::ModelInfo model_info_;
  std::mt19937 rng_{7};
};

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
  ListCommand list(app);
  InfoCommand info(app);
  ReloadCommand reload(app);
  HealthCommand health(app);
  AttendCommand attend(app);
  DecodeCommand decode(app);
  CLI11_PARSE(app, argc, argv);
  attnserve::cli::FinishClientFlags(&options);

  options.deadline = std::chrono::milliseconds(deadline_ms);
  std::unique_ptr<attnserve::Client> client;
  try {
    client = std::make_unique<attnserve::Client>(options);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "attnserve-cli: %s\n", e.what());
    return 2;
  }
  for (Command* c :
       std::initializer_list<Command*>{&list, &info, &reload, &health, &attend, &decode}) {
    if (c->chosen()) return c->Run(*client);
  }
  return 2;  // require_subcommand(1): not reached.
}
