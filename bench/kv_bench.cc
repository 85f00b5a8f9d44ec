// attnserve-kv-bench: what keeping keys and values on the server buys (docs/kv.md "Keys and values
// kept on the server"), measured side by side in one run against a running attnserve. It speaks the
// wire protocol through the generated stub, so the bytes it reports are the messages' exact sizes.
//
//   decode      one sequence decoded token by token, T = 1..N: a session step (the new token only)
//               and, right after it, the same step resending the whole prefix as key and value
//               (query = the new token); per-step latency and bytes, both answers compared.
//   memory      decoder queries against an encoder output of L tokens: a memory versus resending
//   it. concurrent  C callers decoding S steps each, every one on its own session (then resending):
//               tokens/s, step latency, how many steps the server batched together.
//   eviction    more memories than the server's --kv-budget-bytes holds: how many are kept, and
//   what
//               a request naming an evicted one gets.
//   speculative speculative decoding with a D-token draft: each round verifies the draft in one
//               step and accepts a random prefix of it (seeded). On a session: the step, then
//               TruncateSession back to the accepted tokens. Resending: the accepted prefix plus
//               the draft as key and value, the draft as query, masked as the session attends.
//               Round latency and bytes, both answers compared.
//   beam        beam search with W beams over S steps: every step each beam takes one token, then
//               the next beams are drawn from the current ones (seeded; a beam may have several
//               children or none). Forking: a session per beam, ForkSession for a second child,
//               CloseSession for a beam without any. Resending: each beam's whole prefix with its
//               token. Re-prompting: a session per beam, a new one fed the whole prefix as one step
//               for a second child. Time and bytes of the whole search; the answers compared.
//   fork        the cost of ForkSession on a session holding H tokens (--prompt): its latency, the
//               server memory the fork holds (KvHandle.bytes), and its first step's latency beside
//               the parent's next step; the two answers compared with the parent's (same token).
//   batched     S sessions (--callers) of prompts spread over --prompt..--prompt-max, prefilled
//               in batched calls of chunks (16 MiB a call), then stepped one token each: all S in
//               one batched call (AttendRequest.steps) a round, against the same sessions stepping
//               in separate unary calls from S threads, and (--in-process DIR) the engine's own
//               batched step of the same shapes in this process; beside the memory bound of the
//               same run: the bytes a step reads (the weights once per call, shared by its
//               steps, plus the keys and values it attends) over this machine's read bandwidth
//               measured here (a STREAM-like sum over 512 MiB on --threads threads).
//
// Every mode writes one JSON line per result (--json) and prints a table; decode also writes its
// per-step figures as CSV (--csv) for bench/kv.sh to plot.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "bench/kv_in_process.h"

namespace {

namespace pb = ::attnserve::v1;
using Clock = std::chrono::steady_clock;
using Stub = pb::AttentionService::Stub;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// `rows` tokens of width `e`, standard normal, from a fixed seed.
std::vector<float> Tokens(int64_t rows, int64_t e, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> out(static_cast<size_t>(rows * e));
  for (float& x : out) x = normal(rng);
  return out;
}

// Rows [first, first + rows) of `tokens` as a batch-first [1, rows, e] float32 tensor.
void SetTensor(const std::vector<float>& tokens, int64_t first, int64_t rows, int64_t e,
               pb::Tensor* t) {
  t->set_dtype(pb::DATA_TYPE_FLOAT32);
  t->clear_shape();
  t->add_shape(1);
  t->add_shape(rows);
  t->add_shape(e);
  t->set_data(reinterpret_cast<const char*>(tokens.data() + first * e),
              static_cast<size_t>(rows * e) * sizeof(float));
}

const float* Floats(const pb::Tensor& t) { return reinterpret_cast<const float*>(t.data().data()); }

// max |a - b| / max |b|: the error relative to the output's scale.
double RelDiff(const pb::Tensor& a, const pb::Tensor& b) {
  const size_t n = std::min(a.data().size(), b.data().size()) / sizeof(float);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(Floats(a)[i] - Floats(b)[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(Floats(b)[i])));
  }
  if (a.data().size() != b.data().size()) return INFINITY;
  return scale > 0 ? diff / scale : diff;
}

struct Call {
  grpc::Status status;
  double ms = 0;
  size_t request_bytes = 0, response_bytes = 0;
};

template <typename Req, typename Resp, typename Method>
Call Timed(Stub* stub, Method method, const Req& request, Resp* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  const auto start = Clock::now();
  Call c;
  c.status = (stub->*method)(&context, request, response);
  c.ms = Ms(Clock::now() - start);
  c.request_bytes = request.ByteSizeLong();
  c.response_bytes = response->ByteSizeLong();
  return c;
}

[[noreturn]] void Fail(const std::string& what, const grpc::Status& s) {
  std::fprintf(stderr, "attnserve-kv-bench: %s: %d %s\n", what.c_str(),
               static_cast<int>(s.error_code()), s.error_message().c_str());
  std::exit(1);
}

struct Options {
  std::string target = "127.0.0.1:50051";
  std::string model = "demo";
  int64_t embed = 512;
  int steps = 2048;
  int repeats = 3;
  int memory_length = 1024;
  int callers = 32;
  int prompt = 0;
  int prompt_max = 0;  // concurrent: callers' prompts spread evenly over [prompt, prompt_max]
  bool sessions_only = false;
  bool stream = false;  // concurrent: each caller's steps over one AttendStream
  bool async = false;   // concurrent: every caller's steps from one thread, asynchronous calls
  int memories = 64;
  int micro_batches = 0;   // batched: micro-batches pipelined on one AttendStream (0: none)
  int threads = 0;         // batched: threads of the bandwidth read and the in-process engine
  std::string in_process;  // batched: the model directory the in-process engine loads
  std::string device = "cpu", dtype = "float32";  // batched: the in-process engine's
  int draft = 4;
  int beams = 4;
  std::string json, csv;
};

std::shared_ptr<grpc::Channel> Channel(const Options& o) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  // Each caller of `concurrent` gets its own connection, as separate decoders would.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), args);
  // Connected before any call, so no measurement holds a connection's set-up, and so that gRPC
  // 1.51's misreported connect (docs/grpc-workarounds.md 14: an in-progress connect taken for a
  // failure, "No such file or directory", 2 of ~15 runs of 33 connections here) is retried by the
  // channel's own reconnection instead of failing the bench's first call. A server that is not
  // there fails that call as before.
  channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return channel;
}

void WriteJson(const Options& o, const nlohmann::json& j) {
  if (!o.json.empty()) std::ofstream(o.json, std::ios::app) << j.dump() << "\n";
}

std::string OpenSession(Stub* stub, const Options& o) {
  pb::OpenSessionRequest request;
  request.set_model(o.model);
  request.set_batch(1);
  pb::KvHandle handle;
  const Call c = Timed(stub, &Stub::OpenSession, request, &handle);
  if (!c.status.ok()) Fail("OpenSession", c.status);
  return handle.handle();
}

void Release(Stub* stub, const std::string& handle, bool session) {
  pb::ReleaseRequest request;
  request.set_handle(handle);
  pb::ReleaseResponse response;
  const Call c =
      Timed(stub, session ? &Stub::CloseSession : &Stub::DeleteMemory, request, &response);
  if (!c.status.ok()) Fail(session ? "CloseSession" : "DeleteMemory", c.status);
}

// The step at position t (0-based) of a sequence: on a session, or resending tokens [0, t] as key
// and value with the new token as query (what a client without sessions sends).
pb::AttendRequest SessionStep(const std::vector<float>& tokens, int64_t first, int64_t rows,
                              int64_t e, const std::string& session) {
  pb::AttendRequest r;
  r.set_session(session);
  r.set_session_length(first);
  SetTensor(tokens, first, rows, e, r.mutable_query());
  return r;
}
pb::AttendRequest ResendStep(const std::vector<float>& tokens, int64_t t, int64_t e,
                             const std::string& model) {
  pb::AttendRequest r;
  r.set_model(model);
  SetTensor(tokens, t, 1, e, r.mutable_query());
  SetTensor(tokens, 0, t + 1, e, r.mutable_key());
  *r.mutable_value() = r.key();
  return r;
}

// ---- decode
// ----------------------------------------------------------------------------------------

int Decode(const Options& o) {
  auto stub = pb::AttentionService::NewStub(Channel(o));
  const auto tokens = Tokens(o.steps, o.embed, 1);
  struct Step {
    std::vector<double> session_ms, resend_ms;
    size_t session_bytes = 0, resend_bytes = 0;  // Request + response.
  };
  std::vector<Step> steps(static_cast<size_t>(o.steps));
  double worst = 0;
  for (int rep = 0; rep < o.repeats; ++rep) {
    const std::string session = OpenSession(stub.get(), o);
    for (int t = 0; t < o.steps; ++t) {
      pb::AttendRequest a = SessionStep(tokens, t, 1, o.embed, session);
      pb::AttendRequest b = ResendStep(tokens, t, o.embed, o.model);
      pb::AttendResponse ra, rb;
      // Alternate which goes first, so neither always finds the caches warm from the other.
      Call ca, cb;
      if ((t + rep) % 2 == 0) {
        ca = Timed(stub.get(), &Stub::Attend, a, &ra);
        cb = Timed(stub.get(), &Stub::Attend, b, &rb);
      } else {
        cb = Timed(stub.get(), &Stub::Attend, b, &rb);
        ca = Timed(stub.get(), &Stub::Attend, a, &ra);
      }
      if (!ca.status.ok()) Fail("session step " + std::to_string(t + 1), ca.status);
      if (!cb.status.ok()) Fail("resend step " + std::to_string(t + 1), cb.status);
      worst = std::max(worst, RelDiff(ra.output(), rb.output()));
      Step& s = steps[static_cast<size_t>(t)];
      s.session_ms.push_back(ca.ms);
      s.resend_ms.push_back(cb.ms);
      s.session_bytes = ca.request_bytes + ca.response_bytes;
      s.resend_bytes = cb.request_bytes + cb.response_bytes;
    }
    Release(stub.get(), session, true);
    std::fprintf(stderr, "decode: repeat %d of %d done\n", rep + 1, o.repeats);
  }
  if (!o.csv.empty()) {
    std::ofstream csv(o.csv);
    csv << "t,session_ms,resend_ms,session_bytes,resend_bytes\n";
    for (size_t i = 0; i < steps.size(); ++i) {
      const Step& s = steps[i];
      csv << i + 1 << "," << Percentile(s.session_ms, 0.5) << "," << Percentile(s.resend_ms, 0.5)
          << "," << s.session_bytes << "," << s.resend_bytes << "\n";
    }
  }
  // The table: at T = 1, 2, 4, ..., the median over the repeats of the 8 steps ending at T.
  std::printf(
      "decode: E=%lld, one sequence, %d steps, %d repeats; worst |session - resend| / max|resend| "
      "= %.2e\n",
      static_cast<long long>(o.embed), o.steps, o.repeats, worst);
  std::printf("%6s %12s %12s %8s %14s %14s %8s\n", "T", "session ms", "resend ms", "ratio",
              "session bytes", "resend bytes", "ratio");
  nlohmann::json rows = nlohmann::json::array();
  double total_session = 0, total_resend = 0;
  for (const Step& s : steps) {
    for (double x : s.session_ms) total_session += x / o.repeats;
    for (double x : s.resend_ms) total_resend += x / o.repeats;
  }
  for (int T = 1; T <= o.steps; T = T * 2 > o.steps && T != o.steps ? o.steps : T * 2) {
    std::vector<double> sa, sb;
    for (int t = std::max(1, T - 7); t <= T; ++t) {
      const Step& s = steps[static_cast<size_t>(t - 1)];
      sa.insert(sa.end(), s.session_ms.begin(), s.session_ms.end());
      sb.insert(sb.end(), s.resend_ms.begin(), s.resend_ms.end());
    }
    const Step& s = steps[static_cast<size_t>(T - 1)];
    const double ma = Percentile(sa, 0.5), mb = Percentile(sb, 0.5);
    std::printf("%6d %12.3f %12.3f %8.2f %14zu %14zu %8.1f\n", T, ma, mb, mb / ma, s.session_bytes,
                s.resend_bytes,
                static_cast<double>(s.resend_bytes) / static_cast<double>(s.session_bytes));
    rows.push_back({{"T", T},
                    {"session_ms", ma},
                    {"resend_ms", mb},
                    {"session_bytes", s.session_bytes},
                    {"resend_bytes", s.resend_bytes}});
  }
  std::printf("whole sequence (mean over repeats): session %.2f s, resend %.2f s, ratio %.2f\n",
              total_session / 1000, total_resend / 1000, total_resend / total_session);
  // A session's keys and values grow by capacity doubling from 16 tokens: the steps to T = 17, 33,
  // ..., 1025 copy the history once; the others append in place.
  std::printf(
      "session steps that grew the cache (copying the history) vs the steps 1-2 either side:\n");
  nlohmann::json growth = nlohmann::json::array();
  for (int T = 17; T <= o.steps - 2; T = 2 * T - 1) {
    std::vector<double> around;
    for (int t : {T - 2, T - 1, T + 1, T + 2}) {
      const auto& v = steps[static_cast<size_t>(t - 1)].session_ms;
      around.insert(around.end(), v.begin(), v.end());
    }
    const double g = Percentile(steps[static_cast<size_t>(T - 1)].session_ms, 0.5),
                 n = Percentile(around, 0.5);
    std::printf("  T=%5d  grew %.3f ms  neighbours %.3f ms  extra %+.3f ms\n", T, g, n, g - n);
    growth.push_back({{"T", T}, {"grew_ms", g}, {"neighbours_ms", n}});
  }
  WriteJson(o, {{"mode", "decode"},
                {"steps", o.steps},
                {"repeats", o.repeats},
                {"worst_rel_diff", worst},
                {"total_session_s", total_session / 1000},
                {"total_resend_s", total_resend / 1000},
                {"at", rows},
                {"growth", growth}});
  return worst <= 1e-5 ? 0 : 2;
}

// ---- speculative
// -----------------------------------------------------------------------------------

int Speculative(const Options& o) {
  auto stub = pb::AttentionService::NewStub(Channel(o));
  const int64_t d = o.draft, e = o.embed;
  // Enough rows for every draft any round may send: the sequence grows by 0 to d a round.
  const int64_t rows = int64_t{o.steps} * (d + 1) + d;
  const auto tokens = Tokens(rows, e, 4);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> accepted_of(0, static_cast<int>(d));
  std::vector<double> session_ms, resend_ms;
  size_t session_bytes = 0, resend_bytes = 0;
  double worst = 0;
  int64_t held = 0, rounds = 0, drafted = 0;  // Accepted tokens; the draft rounds.
  const std::string session = OpenSession(stub.get(), o);
  // Round r's draft is rows [held, held + d) of a stream that moves on by d every round, so a
  // rejected draft is never sent again.
  int64_t next = 0;
  std::vector<float> kept;  // The accepted rows, in order.
  while (held < o.steps) {
    std::vector<float> draft(tokens.begin() + next * e, tokens.begin() + (next + d) * e);
    next += d;
    // The sequence so far (accepted rows) followed by the draft, for the resend request.
    std::vector<float> seq;
    seq.reserve(static_cast<size_t>((held + d) * e));
    seq.insert(seq.end(), kept.begin(), kept.end());
    seq.insert(seq.end(), draft.begin(), draft.end());

    pb::AttendRequest a = SessionStep(draft, 0, d, e, session);
    a.set_session_length(held);
    pb::AttendRequest b;
    b.set_model(o.model);
    SetTensor(draft, 0, d, e, b.mutable_query());
    SetTensor(seq, 0, held + d, e, b.mutable_key());
    *b.mutable_value() = b.key();
    // Draft row i attends keys 0 .. held + i, as the session's new rows do.
    pb::Tensor* mask = b.mutable_attn_mask();
    mask->set_dtype(pb::DATA_TYPE_BOOL);
    mask->add_shape(d);
    mask->add_shape(held + d);
    std::string bits(static_cast<size_t>(d * (held + d)), '\0');
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = held + i + 1; j < held + d; ++j)
        bits[static_cast<size_t>(i * (held + d) + j)] = 1;
    mask->set_data(bits);

    const int accepted = accepted_of(rng);
    pb::AttendResponse ra, rb;
    pb::TruncateSessionRequest truncate;
    truncate.set_handle(session);
    truncate.set_length(held + accepted);
    pb::KvHandle after;
    Call ca, ct, cb;
    if (rounds % 2 == 0) {
      ca = Timed(stub.get(), &Stub::Attend, a, &ra);
      ct = Timed(stub.get(), &Stub::TruncateSession, truncate, &after);
      cb = Timed(stub.get(), &Stub::Attend, b, &rb);
    } else {
      cb = Timed(stub.get(), &Stub::Attend, b, &rb);
      ca = Timed(stub.get(), &Stub::Attend, a, &ra);
      ct = Timed(stub.get(), &Stub::TruncateSession, truncate, &after);
    }
    if (!ca.status.ok()) Fail("session round " + std::to_string(rounds + 1), ca.status);
    if (!ct.status.ok()) Fail("TruncateSession", ct.status);
    if (!cb.status.ok()) Fail("resend round " + std::to_string(rounds + 1), cb.status);
    if (after.length() != held + accepted) {
      std::fprintf(stderr, "attnserve-kv-bench: truncated to %lld, expected %lld\n",
                   static_cast<long long>(after.length()), static_cast<long long>(held + accepted));
      return 2;
    }
    worst = std::max(worst, RelDiff(ra.output(), rb.output()));
    session_ms.push_back(ca.ms + ct.ms);
    resend_ms.push_back(cb.ms);
    session_bytes += ca.request_bytes + ca.response_bytes + ct.request_bytes + ct.response_bytes;
    resend_bytes += cb.request_bytes + cb.response_bytes;
    kept.insert(kept.end(), draft.begin(), draft.begin() + accepted * e);
    held += accepted;
    drafted += d;
    ++rounds;
  }
  Release(stub.get(), session, true);
  double ts = 0, tr = 0;
  for (double x : session_ms) ts += x;
  for (double x : resend_ms) tr += x;
  std::printf(
      "speculative: E=%lld, %lld-token drafts, %lld rounds to %d accepted tokens (%lld drafted); "
      "worst |session - resend| / max|resend| = %.2e\n",
      static_cast<long long>(e), static_cast<long long>(d), static_cast<long long>(rounds), o.steps,
      static_cast<long long>(drafted), worst);
  std::printf("%28s %12s %12s %8s\n", "", "session", "resend", "ratio");
  std::printf("%28s %12.3f %12.3f %8.2f\n", "round p50 ms", Percentile(session_ms, 0.5),
              Percentile(resend_ms, 0.5), Percentile(resend_ms, 0.5) / Percentile(session_ms, 0.5));
  // The last tenth of the rounds: the longest sequences, where resending costs the most.
  const auto tail_p50 = [rounds](const std::vector<double>& v) {
    return Percentile({v.end() - static_cast<ptrdiff_t>(rounds / 10 + 1), v.end()}, 0.5);
  };
  std::printf("%28s %12.3f %12.3f %8.2f\n", "last tenth of rounds p50 ms", tail_p50(session_ms),
              tail_p50(resend_ms), tail_p50(resend_ms) / tail_p50(session_ms));
  std::printf("%28s %12.2f %12.2f %8.2f\n", "whole sequence s", ts / 1000, tr / 1000, tr / ts);
  std::printf("%28s %12.2f %12.2f %8.1f\n", "bytes on the wire MB", session_bytes / 1e6,
              resend_bytes / 1e6,
              static_cast<double>(resend_bytes) / static_cast<double>(session_bytes));
  WriteJson(o, {{"mode", "speculative"},
                {"draft", d},
                {"accepted", o.steps},
                {"rounds", rounds},
                {"worst_rel_diff", worst},
                {"session_p50_ms", Percentile(session_ms, 0.5)},
                {"session_tail_p50_ms", tail_p50(session_ms)},
                {"resend_tail_p50_ms", tail_p50(resend_ms)},
                {"resend_p50_ms", Percentile(resend_ms, 0.5)},
                {"total_session_s", ts / 1000},
                {"total_resend_s", tr / 1000},
                {"session_bytes", session_bytes},
                {"resend_bytes", resend_bytes}});
  return worst <= 1e-5 ? 0 : 2;
}

// ---- beam
// ------------------------------------------------------------------------------------------

int Beam(const Options& o) {
  auto stub = pb::AttentionService::NewStub(Channel(o));
  const size_t w = static_cast<size_t>(o.beams);
  const int64_t e = o.embed;
  const auto pool = Tokens(int64_t{o.steps} * o.beams, e, 6);  // Step t of beam b: row t * w + b.
  std::mt19937 rng(7);
  std::uniform_int_distribution<size_t> parent_of(0, w - 1);
  struct Cost {
    double ms = 0;
    size_t bytes = 0;
    int64_t calls = 0;
    void Add(const Call& c, const char* what) {
      if (!c.status.ok()) Fail(what, c.status);
      ms += c.ms;
      bytes += c.request_bytes + c.response_bytes;
      ++calls;
    }
  } fork_cost, resend_cost, reprompt_cost;
  // Each beam's rows of `pool`, its forked session, its re-prompted session (fed the whole prefix
  // at its next step when `fresh`).
  struct BeamState {
    std::vector<int64_t> rows;
    std::string forked, reprompted;
    bool fresh = false;
  };
  std::vector<BeamState> beams(w);
  for (BeamState& b : beams) {
    b.forked = OpenSession(stub.get(), o);
    b.reprompted = OpenSession(stub.get(), o);
  }
  const auto close = [&](const std::string& handle, Cost* cost) {
    pb::ReleaseRequest r;
    r.set_handle(handle);
    pb::ReleaseResponse rr;
    cost->Add(Timed(stub.get(), &Stub::CloseSession, r, &rr), "CloseSession");
  };
  double worst = 0;
  for (int t = 0; t < o.steps; ++t) {
    for (size_t i = 0; i < w; ++i) {
      BeamState& b = beams[i];
      b.rows.push_back(int64_t{t} * o.beams + static_cast<int64_t>(i));
      std::vector<float> tokens;
      tokens.reserve(b.rows.size() * static_cast<size_t>(e));
      for (int64_t r : b.rows)
        tokens.insert(tokens.end(), pool.begin() + r * e, pool.begin() + (r + 1) * e);
      const int64_t n = static_cast<int64_t>(b.rows.size());
      pb::AttendResponse ra, rb, rc;
      fork_cost.Add(
          Timed(stub.get(), &Stub::Attend, SessionStep(tokens, n - 1, 1, e, b.forked), &ra),
          "fork: a beam's step");
      resend_cost.Add(Timed(stub.get(), &Stub::Attend, ResendStep(tokens, n - 1, e, o.model), &rb),
                      "resend: a beam's step");
      const int64_t first = b.fresh ? 0 : n - 1;
      reprompt_cost.Add(Timed(stub.get(), &Stub::Attend,
                              SessionStep(tokens, first, n - first, e, b.reprompted), &rc),
                        "re-prompt: a beam's step");
      b.fresh = false;
      worst = std::max(worst, RelDiff(ra.output(), rb.output()));
      pb::Tensor last = rc.output();  // Its last row is the new token's.
      last.set_data(last.data().substr(static_cast<size_t>((n - first - 1) * e) * sizeof(float)));
      worst = std::max(worst, RelDiff(last, rb.output()));
    }
    if (t + 1 == o.steps) break;
    // The next beams, each drawn from a current one: its first child continues its sessions, a
    // second one forks (or opens a session to re-prompt), a beam with no child is closed.
    std::vector<BeamState> next(w);
    std::vector<bool> taken(w, false);
    for (BeamState& child : next) {
      const size_t p = parent_of(rng);
      child.rows = beams[p].rows;
      if (!taken[p]) {
        taken[p] = true;
        child.forked = beams[p].forked;
        child.reprompted = beams[p].reprompted;
        continue;
      }
      pb::ForkSessionRequest fr;
      fr.set_handle(beams[p].forked);
      pb::KvHandle fh, oh;
      fork_cost.Add(Timed(stub.get(), &Stub::ForkSession, fr, &fh), "ForkSession");
      child.forked = fh.handle();
      pb::OpenSessionRequest open;
      open.set_model(o.model);
      open.set_batch(1);
      reprompt_cost.Add(Timed(stub.get(), &Stub::OpenSession, open, &oh), "OpenSession");
      child.reprompted = oh.handle();
      child.fresh = true;
    }
    for (size_t p = 0; p < w; ++p) {
      if (taken[p]) continue;
      close(beams[p].forked, &fork_cost);
      close(beams[p].reprompted, &reprompt_cost);
    }
    beams = std::move(next);
  }
  for (BeamState& b : beams) {
    Release(stub.get(), b.forked, true);
    Release(stub.get(), b.reprompted, true);
  }
  std::printf(
      "beam: E=%lld, %zu beams, %d steps; worst relative difference between the forms %.2e\n",
      static_cast<long long>(e), w, o.steps, worst);
  std::printf("%12s %8s %10s %9s %12s %9s\n", "", "calls", "seconds", "vs fork", "MB on wire",
              "vs fork");
  for (const auto& [name, c] :
       {std::pair{"fork", &fork_cost}, {"resend", &resend_cost}, {"re-prompt", &reprompt_cost}}) {
    std::printf("%12s %8lld %10.2f %9.2f %12.2f %9.1f\n", name, static_cast<long long>(c->calls),
                c->ms / 1000, c->ms / fork_cost.ms, static_cast<double>(c->bytes) / 1e6,
                static_cast<double>(c->bytes) / static_cast<double>(fork_cost.bytes));
  }
  WriteJson(o, {{"mode", "beam"},
                {"beams", o.beams},
                {"steps", o.steps},
                {"worst_rel_diff", worst},
                {"fork_s", fork_cost.ms / 1000},
                {"resend_s", resend_cost.ms / 1000},
                {"reprompt_s", reprompt_cost.ms / 1000},
                {"fork_bytes", fork_cost.bytes},
                {"resend_bytes", resend_cost.bytes},
                {"reprompt_bytes", reprompt_cost.bytes}});
  return worst <= 1e-5 ? 0 : 2;
}

// ---- fork
// ----------------------------------------------------------------------------------------

int Fork(const Options& o) {
  auto stub = pb::AttentionService::NewStub(Channel(o));
  const int64_t e = o.embed, h = o.prompt > 0 ? o.prompt : 2048;
  const auto tokens = Tokens(h + 1, e, 9);
  const std::string parent = OpenSession(stub.get(), o);
  pb::AttendResponse out;
  const Call prompt = Timed(stub.get(), &Stub::Attend, SessionStep(tokens, 0, h, e, parent), &out);
  if (!prompt.status.ok()) Fail("Attend (prompt)", prompt.status);
  std::vector<double> fork_ms, fork_step_ms, parent_step_ms;
  int64_t fork_bytes = 0, parent_bytes = 0;
  double worst = 0;
  for (int r = 0; r < o.repeats; ++r) {
    pb::ForkSessionRequest fr;
    fr.set_handle(parent);
    pb::KvHandle child;
    const Call f = Timed(stub.get(), &Stub::ForkSession, fr, &child);
    if (!f.status.ok()) Fail("ForkSession", f.status);
    fork_ms.push_back(f.ms);
    fork_bytes = child.bytes();
    // The same next token on the fork and on the parent (then the parent is taken back).
    pb::AttendResponse a, b;
    const Call cs =
        Timed(stub.get(), &Stub::Attend, SessionStep(tokens, h, 1, e, child.handle()), &a);
    if (!cs.status.ok()) Fail("Attend (fork's step)", cs.status);
    const Call ps = Timed(stub.get(), &Stub::Attend, SessionStep(tokens, h, 1, e, parent), &b);
    if (!ps.status.ok()) Fail("Attend (parent's step)", ps.status);
    fork_step_ms.push_back(cs.ms);
    parent_step_ms.push_back(ps.ms);
    worst = std::max(worst, RelDiff(a.output(), b.output()));
    pb::TruncateSessionRequest tr;
    tr.set_handle(parent);
    tr.set_length(h);
    pb::KvHandle after;
    const Call t = Timed(stub.get(), &Stub::TruncateSession, tr, &after);
    if (!t.status.ok()) Fail("TruncateSession", t.status);
    parent_bytes = after.bytes();
    Release(stub.get(), child.handle(), true);
  }
  Release(stub.get(), parent, true);
  const double fork_p50 = Percentile(fork_ms, 0.5);
  std::printf(
      "fork: E=%lld, a %lld-token history, %d forks; the fork's and the parent's next step "
      "differ by %.2e\n"
      "  ForkSession p50 %.3f ms; the fork holds %lld bytes (the parent %lld)\n"
      "  next step p50: fork %.3f ms, parent %.3f ms\n",
      static_cast<long long>(e), static_cast<long long>(h), o.repeats, worst, fork_p50,
      static_cast<long long>(fork_bytes), static_cast<long long>(parent_bytes),
      Percentile(fork_step_ms, 0.5), Percentile(parent_step_ms, 0.5));
  WriteJson(o, {{"mode", "fork"},
                {"history", h},
                {"forks", o.repeats},
                {"fork_ms_p50", fork_p50},
                {"fork_bytes", fork_bytes},
                {"parent_bytes", parent_bytes},
                {"fork_step_ms_p50", Percentile(fork_step_ms, 0.5)},
                {"parent_step_ms_p50", Percentile(parent_step_ms, 0.5)},
                {"worst_rel_diff", worst}});
  return worst <= 1e-5 ? 0 : 1;
}

// ---- memory
// ----------------------------------------------------------------------------------------

int Memory(const Options& o) {
  auto stub = pb::AttentionService::NewStub(Channel(o));
  const auto encoder = Tokens(o.memory_length, o.embed, 2);
  const auto queries = Tokens(o.steps, o.embed, 3);
  pb::CreateMemoryRequest create;
  create.set_model(o.model);
  SetTensor(encoder, 0, o.memory_length, o.embed, create.mutable_key());
  *create.mutable_value() = create.key();
  pb::KvHandle memory;
  const Call cc = Timed(stub.get(), &Stub::CreateMemory, create, &memory);
  if (!cc.status.ok()) Fail("CreateMemory", cc.status);

  std::vector<double> ma, mb;
  size_t bytes_a = 0, bytes_b = 0;
  double worst = 0;
  for (int i = 0; i < o.steps; ++i) {
    pb::AttendRequest a, b;
    a.set_memory(memory.handle());
    SetTensor(queries, i, 1, o.embed, a.mutable_query());
    b.set_model(o.model);
    SetTensor(queries, i, 1, o.embed, b.mutable_query());
    *b.mutable_key() = create.key();
    *b.mutable_value() = create.value();
    pb::AttendResponse ra, rb;
    Call ca, cb;
    if (i % 2 == 0) {
      ca = Timed(stub.get(), &Stub::Attend, a, &ra);
      cb = Timed(stub.get(), &Stub::Attend, b, &rb);
    } else {
      cb = Timed(stub.get(), &Stub::Attend, b, &rb);
      ca = Timed(stub.get(), &Stub::Attend, a, &ra);
    }
    if (!ca.status.ok()) Fail("memory query", ca.status);
    if (!cb.status.ok()) Fail("resent query", cb.status);
    worst = std::max(worst, RelDiff(ra.output(), rb.output()));
    ma.push_back(ca.ms);
    mb.push_back(cb.ms);
    bytes_a = ca.request_bytes + ca.response_bytes;
    bytes_b = cb.request_bytes + cb.response_bytes;
  }
  Release(stub.get(), memory.handle(), false);
  const double pa = Percentile(ma, 0.5), pb50 = Percentile(mb, 0.5);
  std::printf(
      "memory: %d-token encoder output (E=%lld), %d one-token queries; worst rel diff %.2e\n",
      o.memory_length, static_cast<long long>(o.embed), o.steps, worst);
  std::printf("  CreateMemory once: %.2f ms, %zu bytes sent, holds %lld bytes on the server\n",
              cc.ms, cc.request_bytes, static_cast<long long>(memory.bytes()));
  std::printf(
      "  per query   memory: p50 %.3f ms p90 %.3f ms, %zu bytes   resend: p50 %.3f ms p90 %.3f ms, "
      "%zu bytes\n",
      pa, Percentile(ma, 0.9), bytes_a, pb50, Percentile(mb, 0.9), bytes_b);
  std::printf(
      "  resend / memory: latency %.2f, bytes %.1f; memory pays for itself after %.1f queries\n",
      pb50 / pa, static_cast<double>(bytes_b) / static_cast<double>(bytes_a),
      cc.ms / std::max(1e-9, pb50 - pa));
  WriteJson(o, {{"mode", "memory"},
                {"length", o.memory_length},
                {"queries", o.steps},
                {"create_ms", cc.ms},
                {"create_bytes", cc.request_bytes},
                {"held_bytes", memory.bytes()},
                {"memory_p50_ms", pa},
                {"memory_p90_ms", Percentile(ma, 0.9)},
                {"memory_bytes", bytes_a},
                {"resend_p50_ms", pb50},
                {"resend_p90_ms", Percentile(mb, 0.9)},
                {"resend_bytes", bytes_b},
                {"worst_rel_diff", worst}});
  return worst <= 1e-5 ? 0 : 2;
}

// ---- concurrent
// ------------------------------------------------------------------------------------

// A caller of `concurrent --async`: its connection, session (empty: resending) and sequence.
struct AsyncCaller {
  std::unique_ptr<Stub> stub;
  std::string session;
  std::vector<float> tokens;
  int prompt = 0;
};

// Every caller's steps from this thread: one asynchronous Attend in flight per caller on one
// completion queue, the next sent when its answer arrives; latencies, answer times and batch
// sizes as the threaded form records them. Sessions are closed at the end.
void DriveAsync(const Options& o, bool sessions, std::vector<AsyncCaller>* callers,
                std::vector<std::vector<double>>* lat,
                std::vector<std::vector<Clock::time_point>>* answered,
                std::atomic<int64_t>* batch_sum, std::atomic<int64_t>* steps_done) {
  struct InFlight {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientAsyncResponseReader<pb::AttendResponse>> call;
    pb::AttendResponse response;
    grpc::Status status;
    Clock::time_point sent;
    int t = 0;
  };
  grpc::CompletionQueue cq;
  std::vector<InFlight> flights(callers->size());
  const auto send = [&](size_t c) {
    AsyncCaller& caller = (*callers)[c];
    InFlight& f = flights[c];
    f.context = std::make_unique<grpc::ClientContext>();
    f.context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    f.response.Clear();
    const pb::AttendRequest request =
        sessions ? SessionStep(caller.tokens, f.t, 1, o.embed, caller.session)
                 : ResendStep(caller.tokens, f.t, o.embed, o.model);
    f.sent = Clock::now();
    f.call = caller.stub->AsyncAttend(f.context.get(), request, &cq);
    f.call->Finish(&f.response, &f.status, reinterpret_cast<void*>(c));
  };
  size_t active = 0;
  for (size_t c = 0; c < callers->size(); ++c) {
    flights[c].t = (*callers)[c].prompt;
    if (o.steps > 0) {
      send(c);
      ++active;
    }
  }
  while (active > 0) {
    void* tag = nullptr;
    bool ok = false;
    if (!cq.Next(&tag, &ok)) break;
    const size_t c = reinterpret_cast<size_t>(tag);
    InFlight& f = flights[c];
    if (!ok || !f.status.ok()) Fail(sessions ? "session step" : "resend step", f.status);
    const Clock::time_point now = Clock::now();
    (*lat)[c].push_back(Ms(now - f.sent));
    (*answered)[c].push_back(now);
    *batch_sum += f.response.timing().batch_size();
    ++*steps_done;
    if (++f.t < (*callers)[c].prompt + o.steps) {
      send(c);
    } else {
      --active;
    }
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  for (AsyncCaller& caller : *callers) {
    if (sessions) Release(caller.stub.get(), caller.session, true);
  }
}

int Concurrent(const Options& o) {
  // Caller c's prompt: o.prompt, or spread evenly up to o.prompt_max.
  const auto prompt_of = [&](int c) {
    if (o.prompt_max <= o.prompt || o.callers < 2) return o.prompt;
    return o.prompt +
           static_cast<int>(static_cast<int64_t>(o.prompt_max - o.prompt) * c / (o.callers - 1));
  };
  // The kept tokens a step attends over, on average over every step of every caller.
  double kept = 0;
  for (int c = 0; c < o.callers; ++c) kept += prompt_of(c) + (o.steps + 1) / 2.0;
  kept /= std::max(o.callers, 1);
  nlohmann::json out = {{"mode", "concurrent"},
                        {"callers", o.callers},
                        {"steps", o.steps},
                        {"prompt", o.prompt},
                        {"prompt_max", std::max(o.prompt, o.prompt_max)},
                        {"kept_tokens_mean", kept},
                        {"embed", o.embed}};
  std::printf(
      "concurrent: %d callers, each a sequence of %d..%d prompt tokens then %d one-token steps "
      "(E=%lld; %.0f kept tokens a step on average)\n",
      o.callers, o.prompt, std::max(o.prompt, o.prompt_max), o.steps,
      static_cast<long long>(o.embed), kept);
  std::printf("%-8s %12s %10s %10s %10s %12s %12s %8s\n", "form", "tokens/s", "p50 ms", "p99 ms",
              "wall s", "mean batch", "all-in t/s", "all-in s");
  double rate[2] = {0, 0};
  for (int form = 0; form < (o.sessions_only ? 1 : 2); ++form) {  // 0: sessions, 1: resend.
    const bool sessions = form == 0;
    std::vector<std::vector<double>> lat(static_cast<size_t>(o.callers));
    // When each caller's steps were answered: the window in which every caller was stepping.
    std::vector<std::vector<Clock::time_point>> answered(static_cast<size_t>(o.callers));
    std::atomic<int64_t> batch_sum{0}, steps_done{0};
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    std::vector<AsyncCaller> async_callers(static_cast<size_t>(o.callers));
    Clock::time_point start;
    for (int c = 0; c < o.callers; ++c) {
      threads.emplace_back([&, c] {
        auto stub = pb::AttentionService::NewStub(Channel(o));
        const int prompt = prompt_of(c);
        const auto tokens = Tokens(prompt + o.steps, o.embed, 100 + static_cast<uint32_t>(c));
        std::string session;
        if (sessions) {
          session = OpenSession(stub.get(), o);
          if (prompt > 0) {
            pb::AttendResponse r;
            const Call p = Timed(stub.get(), &Stub::Attend,
                                 SessionStep(tokens, 0, prompt, o.embed, session), &r);
            if (!p.status.ok()) Fail("prompt", p.status);
          }
        }
        // --stream: the steps as messages of one AttendStream, each read before the next is sent.
        grpc::ClientContext stream_context;
        std::unique_ptr<grpc::ClientReaderWriter<pb::AttendRequest, pb::AttendResponse>> stream;
        if (o.stream) stream = stub->AttendStream(&stream_context);
        if (o.async) {  // The steps go from the driver below; the session is closed there.
          async_callers[static_cast<size_t>(c)] = {std::move(stub), session, tokens, prompt};
          ++ready;
          return;
        }
        ++ready;
        while (!go) std::this_thread::yield();
        for (int t = prompt; t < prompt + o.steps; ++t) {
          const pb::AttendRequest request = sessions ? SessionStep(tokens, t, 1, o.embed, session)
                                                     : ResendStep(tokens, t, o.embed, o.model);
          pb::AttendResponse r;
          Call call;
          if (stream) {
            const auto sent = Clock::now();
            if (!stream->Write(request) || !stream->Read(&r)) Fail("stream step", stream->Finish());
            call.ms = Ms(Clock::now() - sent);
            if (r.has_error()) {
              call.status = grpc::Status(static_cast<grpc::StatusCode>(r.error().code()),
                                         r.error().message());
            }
          } else {
            call = Timed(stub.get(), &Stub::Attend, request, &r);
          }
          if (!call.status.ok()) Fail(sessions ? "session step" : "resend step", call.status);
          lat[static_cast<size_t>(c)].push_back(call.ms);
          answered[static_cast<size_t>(c)].push_back(Clock::now());
          batch_sum += r.timing().batch_size();
          ++steps_done;
        }
        if (stream) {
          stream->WritesDone();
          const grpc::Status st = stream->Finish();
          if (!st.ok()) Fail("stream", st);
        }
        if (sessions) Release(stub.get(), session, true);
      });
    }
    while (ready < o.callers) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (o.async) {
      for (auto& t : threads) t.join();
      start = Clock::now();
      DriveAsync(o, sessions, &async_callers, &lat, &answered, &batch_sum, &steps_done);
    } else {
      start = Clock::now();
      go = true;
      for (auto& t : threads) t.join();
    }
    const double wall = Ms(Clock::now() - start) / 1000;
    std::vector<double> all;
    for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
    rate[form] = static_cast<double>(steps_done) / wall;
    const double mean_batch = static_cast<double>(batch_sum) / static_cast<double>(steps_done);
    // Until the first caller's last answer every caller was stepping: the rate of that window
    // (the wall's rate also counts the tail, where fewer callers are left).
    Clock::time_point first_done = Clock::time_point::max();
    for (const auto& a : answered) {
      if (!a.empty()) first_done = std::min(first_done, a.back());
    }
    int64_t in_window = 0;
    for (const auto& a : answered)
      in_window += std::upper_bound(a.begin(), a.end(), first_done) - a.begin();
    const double window =
        first_done == Clock::time_point::max() ? 0 : Ms(first_done - start) / 1000;
    const double all_rate = window > 0 ? static_cast<double>(in_window) / window : 0;
    std::printf("%-8s %12.0f %10.2f %10.2f %10.2f %12.1f %12.0f %8.2f\n",
                sessions ? "session" : "resend", rate[form], Percentile(all, 0.5),
                Percentile(all, 0.99), wall, mean_batch, all_rate, window);
    out[sessions ? "session" : "resend"] = {{"tokens_per_s", rate[form]},
                                            {"p50_ms", Percentile(all, 0.5)},
                                            {"p99_ms", Percentile(all, 0.99)},
                                            {"wall_s", wall},
                                            {"mean_batch", mean_batch},
                                            {"all_in_tokens_per_s", all_rate},
                                            {"all_in_s", window}};
  }
  if (!o.sessions_only) std::printf("session / resend tokens/s: %.2f\n", rate[0] / rate[1]);
  WriteJson(o, out);
  return 0;
}

// ---- batched
// ---------------------------------------------------------------------------------------

// Read bandwidth in GB/s: `threads` threads each summing its part of a 512 MiB buffer (far past
// the caches), the best of 5 passes; what a decoding step's bytes are read at, at best.
__attribute__((optimize("O3", "tree-vectorize"))) uint64_t SumWords(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  return a + b + c + d;
}

double ReadBandwidthGBs(int threads) {
  const size_t words = (size_t{512} << 20) / sizeof(uint64_t);
  static std::vector<uint64_t> buf(words, 1);  // Made once: every measurement reads it again.
  double best = 0;
  std::atomic<uint64_t> sink{0};
  for (int pass = 0; pass < 5; ++pass) {
    std::vector<std::thread> ts;
    const auto start = Clock::now();
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const size_t from = words * static_cast<size_t>(t) / static_cast<size_t>(threads);
        const size_t to = words * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
        sink += SumWords(buf.data() + from, to - from);
      });
    }
    for (auto& t : ts) t.join();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, static_cast<double>(words * sizeof(uint64_t)) / s / 1e9);
  }
  if (sink == 0) std::printf(" ");  // Keeps the sums.
  return best;
}

// The model's shape from GetModel: the bytes its weights take, and a token's kept bytes.
struct LayerBytes {
  double weights = 0, kv_per_token = 0;
  std::string dtype;
};
LayerBytes LayerOf(Stub* stub, const Options& o) {
  pb::GetModelRequest request;
  request.set_name(o.model);
  pb::ModelInfo info;
  const Call c = Timed(stub, &Stub::GetModel, request, &info);
  if (!c.status.ok()) Fail("GetModel", c.status);
  const double elem = info.compute_dtype() == pb::DATA_TYPE_FLOAT32 ? 4 : 2;
  const double d = static_cast<double>(info.head_dim() > 0 ? info.head_dim()
                                                           : info.embed_dim() / info.num_heads());
  const double qw = static_cast<double>(info.num_heads()) * d;
  const double kvw =
      static_cast<double>(info.num_kv_heads() > 0 ? info.num_kv_heads() : info.num_heads()) * d;
  const double e = static_cast<double>(info.embed_dim());
  LayerBytes b;
  b.weights = elem * e * (2 * qw + 2 * kvw);  // q, k, v and out projections
  b.kv_per_token = elem * 2 * kvw;
  b.dtype = pb::DataType_Name(info.compute_dtype());
  return b;
}

int Batched(const Options& o) {
  const int s_count = o.callers;
  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> prompts;
  for (int c = 0; c < s_count; ++c) {
    prompts.push_back(o.prompt_max <= o.prompt || s_count < 2
                          ? o.prompt
                          : o.prompt +
                                static_cast<int>(static_cast<int64_t>(o.prompt_max - o.prompt) * c /
                                                 (s_count - 1)));
  }
  auto stub = pb::AttentionService::NewStub(Channel(o));
  const LayerBytes layer = LayerOf(stub.get(), o);
  std::vector<std::string> sessions;
  std::vector<std::vector<float>> tokens;
  const int rounds = o.steps;
  const int forms = o.micro_batches > 0 ? 3 : 2;  // unary batched, separate, [pipelined]
  for (int c = 0; c < s_count; ++c) {
    sessions.push_back(OpenSession(stub.get(), o));
    // Every form's steps of this session, after its prompt: forms x repeats x rounds.
    tokens.push_back(Tokens(prompts[c] + forms * o.repeats * rounds + 1, o.embed,
                            300 + static_cast<uint32_t>(c)));
  }
  std::vector<int64_t> length(static_cast<size_t>(s_count), 0);
  // One batched step of up to `rows` tokens for every session of [from, to) with tokens of `upto`
  // left; `in` gets the sessions it carries.
  const auto make_step = [&](int from, int to, const std::vector<int64_t>& upto, int64_t rows,
                             std::vector<int>* in) {
    pb::AttendRequest request;
    in->clear();
    for (int c = from; c < to; ++c) {
      const int64_t n = std::min<int64_t>(rows, upto[c] - length[c]);
      if (n <= 0) continue;
      pb::Step* step = request.add_steps();
      step->set_session(sessions[c]);
      step->set_session_length(length[c]);
      SetTensor(tokens[c], length[c], n, o.embed, step->mutable_query());
      in->push_back(c);
    }
    return request;
  };
  // A batched step's answer: every entry's, its sessions' new lengths taken.
  const auto take_step = [&](const std::vector<int>& in, const pb::AttendResponse& r) {
    if (r.has_error()) {
      Fail("batched step",
           grpc::Status(static_cast<grpc::StatusCode>(r.error().code()), r.error().message()));
    }
    for (size_t i = 0; i < in.size(); ++i) {
      const pb::StepResult& res = r.steps(static_cast<int>(i));
      if (res.has_error()) {
        Fail(
            "batched step entry " + std::to_string(i),
            grpc::Status(static_cast<grpc::StatusCode>(res.error().code()), res.error().message()));
      }
      length[in[i]] = res.session_length();
    }
  };
  // One unary batched call of every session.
  const auto batched_step = [&](const std::vector<int64_t>& upto, int64_t rows,
                                pb::AttendResponse* r) {
    std::vector<int> in;
    const pb::AttendRequest request = make_step(0, s_count, upto, rows, &in);
    if (in.empty()) return Call{};
    const Call call = Timed(stub.get(), &Stub::Attend, request, r);
    if (!call.status.ok()) Fail("batched step", call.status);
    take_step(in, *r);
    return call;
  };
  // `rounds` steps of every session as o.micro_batches micro-batches (sessions split evenly), each
  // a batched step, all in flight on one AttendStream: a micro-batch's next step is sent as soon
  // as its answer arrives (what a runner pipelining micro-batches does); the steps a second.
  const auto pipelined_rounds = [&](std::vector<double>* ms) {
    const int m_count = std::clamp(o.micro_batches, 1, s_count);
    grpc::ClientContext context;
    auto stream = stub->AttendStream(&context);
    std::vector<std::vector<int>> in(static_cast<size_t>(m_count));
    std::vector<int> left(static_cast<size_t>(m_count), rounds);
    std::vector<Clock::time_point> sent(static_cast<size_t>(m_count));
    const auto send = [&](int m) {
      std::vector<int64_t> upto(length.begin(), length.end());
      for (int64_t& u : upto) ++u;
      pb::AttendRequest request = make_step(s_count * m / m_count, s_count * (m + 1) / m_count,
                                            upto, 1, &in[static_cast<size_t>(m)]);
      request.set_request_id(static_cast<uint64_t>(m));
      sent[static_cast<size_t>(m)] = Clock::now();
      if (!stream->Write(request)) Fail("pipelined step", stream->Finish());
      --left[static_cast<size_t>(m)];
    };
    const auto start = Clock::now();
    for (int m = 0; m < m_count; ++m) send(m);
    for (int pending = m_count; pending > 0;) {
      pb::AttendResponse r;
      if (!stream->Read(&r)) Fail("pipelined step", stream->Finish());
      const int m = static_cast<int>(r.request_id());
      if (m < 0 || m >= m_count) Fail("pipelined step", grpc::Status(grpc::INTERNAL, "request_id"));
      ms->push_back(Ms(Clock::now() - sent[static_cast<size_t>(m)]));
      take_step(in[static_cast<size_t>(m)], r);
      if (left[static_cast<size_t>(m)] > 0) {
        send(m);
      } else {
        --pending;
      }
    }
    const double s = Ms(Clock::now() - start) / 1000;
    stream->WritesDone();
    const grpc::Status st = stream->Finish();
    if (!st.ok()) Fail("pipelined stream", st);
    return rounds * s_count / s;
  };
  // Prefill: every session's prompt in chunks, all sessions in each call, each call's query
  // within 16 MiB (the server's messages are 64 MiB at most).
  const int64_t chunk = std::clamp<int64_t>((int64_t{16} << 20) / (s_count * o.embed * 4), 1, 256);
  const auto prefill_start = Clock::now();
  for (;;) {
    pb::AttendResponse r;
    std::vector<int64_t> upto(prompts.begin(), prompts.end());
    const Call c = batched_step(upto, chunk, &r);
    if (c.ms == 0) break;
  }
  const double prefill_s = Ms(Clock::now() - prefill_start) / 1000;
  double kept = 0;  // Kept tokens a step attends over, on average.
  for (int p : prompts) kept += p + forms * o.repeats * rounds / 2.0;
  kept /= std::max(s_count, 1);
  const double kv_step = layer.kv_per_token * kept;
  // The memory bound: a batched call reads the weights once for its S steps.
  const double bytes_batched = layer.weights / s_count + kv_step;
  std::printf(
      "batched: %d sessions, prompts %d..%d (%.0f kept tokens a step on average), E=%lld, %s; "
      "prefill %.1f s; CPU class %s\n"
      "  a step reads %.2f MB of keys and values, the weights %.1f MB a call (%.2f MB a step "
      "shared by %d)\n",
      s_count, o.prompt, std::max(o.prompt, o.prompt_max), kept, static_cast<long long>(o.embed),
      layer.dtype.c_str(), prefill_s, attnserve_bench::CpuClass().c_str(), kv_step / 1e6,
      layer.weights / 1e6, layer.weights / s_count / 1e6, s_count);
  // The engine's own batched step in this process, its sessions prefilled now: its rounds then
  // alternate with the server's, so that each repeat's ratios are of neighbours in time.
  std::unique_ptr<attnserve_bench::InProcessStepper> engine;
  if (!o.in_process.empty()) {
    engine = std::make_unique<attnserve_bench::InProcessStepper>(
        o.in_process, prompts, rounds * o.repeats, threads, o.device, o.dtype);
    if (!engine->error().empty()) {
      std::fprintf(stderr, "attnserve-kv-bench: in-process: %s\n", engine->error().c_str());
      return 1;
    }
  }
  std::vector<double> batched_rate, separate_rate, engine_rate, batched_ms, separate_ms, engine_ms;
  std::vector<double> server_queue_ms, server_compute_ms;  // The batched calls' own timing.
  std::vector<double> to_separate, to_engine;              // Each repeat's ratios.
  double batch_sum = 0, batch_n = 0;
  std::vector<double> read_gbs, to_bound;  // Each repeat's read bandwidth, and its batched ratio.
  std::vector<double> pipelined_rate, pipelined_ms, pipelined_to_bound, pipelined_to_separate;
  for (int rep = 0; rep < o.repeats; ++rep) {
    read_gbs.push_back(ReadBandwidthGBs(threads));  // This repeat's, right before its rounds.
    const double bound_now = read_gbs.back() * 1e9 / bytes_batched;  // Steps/s at the bound.
    // All S sessions in one call, `rounds` times.
    auto start = Clock::now();
    for (int round = 0; round < rounds; ++round) {
      pb::AttendResponse r;
      std::vector<int64_t> upto(length.begin(), length.end());
      for (int64_t& u : upto) ++u;
      batched_ms.push_back(batched_step(upto, 1, &r).ms);
      server_queue_ms.push_back(r.timing().queue_seconds() * 1e3);
      server_compute_ms.push_back(r.timing().compute_seconds() * 1e3);
    }
    batched_rate.push_back(rounds * s_count / (Ms(Clock::now() - start) / 1000));
    to_bound.push_back(batched_rate.back() / bound_now);
    if (engine) {  // The engine's own, right after.
      engine_rate.push_back(engine->Rounds(rounds, &engine_ms));
      if (!engine->error().empty()) {
        std::fprintf(stderr, "attnserve-kv-bench: in-process: %s\n", engine->error().c_str());
        return 1;
      }
      to_engine.push_back(batched_rate.back() / engine_rate.back());
    }
    if (o.micro_batches > 0) {  // The same sessions as micro-batches pipelined on a stream.
      pipelined_rate.push_back(pipelined_rounds(&pipelined_ms));
      pipelined_to_bound.push_back(pipelined_rate.back() / bound_now);
    }
    // The same sessions, each stepped by a thread of its own in separate unary calls.
    std::vector<std::thread> ts;
    std::vector<std::vector<double>> lat(static_cast<size_t>(s_count));
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::mutex mu;
    for (int c = 0; c < s_count; ++c) {
      ts.emplace_back([&, c] {
        auto own = pb::AttentionService::NewStub(Channel(o));
        ++ready;
        while (!go) std::this_thread::yield();
        for (int round = 0; round < rounds; ++round) {
          pb::AttendResponse r;
          const Call call = Timed(own.get(), &Stub::Attend,
                                  SessionStep(tokens[c], length[c], 1, o.embed, sessions[c]), &r);
          if (!call.status.ok()) Fail("separate step", call.status);
          ++length[c];
          lat[static_cast<size_t>(c)].push_back(call.ms);
          std::lock_guard<std::mutex> lock(mu);
          batch_sum += r.timing().batch_size();
          ++batch_n;
        }
      });
    }
    while (ready < s_count) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    start = Clock::now();
    go = true;
    for (auto& t : ts) t.join();
    separate_rate.push_back(rounds * s_count / (Ms(Clock::now() - start) / 1000));
    for (auto& l : lat) separate_ms.insert(separate_ms.end(), l.begin(), l.end());
    to_separate.push_back(batched_rate.back() / separate_rate.back());
    if (o.micro_batches > 0)
      pipelined_to_separate.push_back(pipelined_rate.back() / separate_rate.back());
  }
  for (const std::string& h : sessions) Release(stub.get(), h, true);
  const double batched = Percentile(batched_rate, 0.5), separate = Percentile(separate_rate, 0.5);
  // The memory bound: each repeat's read bandwidth (a STREAM-like read right before its rounds;
  // on a shared host it drifts from minute to minute), the median for the table.
  const double bandwidth = Percentile(read_gbs, 0.5);
  const double bound = bandwidth * 1e9 / bytes_batched;
  std::printf(
      "  read bandwidth %.1f GB/s on %d threads (the repeats' median; %.1f..%.1f): memory "
      "bound %.0f steps/s\n",
      bandwidth, threads, *std::min_element(read_gbs.begin(), read_gbs.end()),
      *std::max_element(read_gbs.begin(), read_gbs.end()), bound);
  std::printf("%-34s %12s %10s %10s %10s\n", "form", "steps/s", "p50 ms", "p90 ms", "/ bound");
  std::printf(
      "%-34s %12.0f %10.2f %10.2f %10.2f   server: queue %.2f, compute %.2f (p90 %.2f) ms (p50)\n",
      "batched call (all sessions)", batched, Percentile(batched_ms, 0.5),
      Percentile(batched_ms, 0.9), batched / bound, Percentile(server_queue_ms, 0.5),
      Percentile(server_compute_ms, 0.5), Percentile(server_compute_ms, 0.9));
  if (o.micro_batches > 0) {
    const double rate = Percentile(pipelined_rate, 0.5);
    const std::string form =
        "batched, " + std::to_string(std::clamp(o.micro_batches, 1, s_count)) + " on a stream";
    std::printf("%-34s %12.0f %10.2f %10.2f %10.2f   micro-batches in flight together\n",
                form.c_str(), rate, Percentile(pipelined_ms, 0.5), Percentile(pipelined_ms, 0.9),
                rate / bound);
  }
  std::printf("%-34s %12.0f %10.2f %10.2f %10.2f   mean batch %.1f\n", "separate unary calls",
              separate, Percentile(separate_ms, 0.5), Percentile(separate_ms, 0.9),
              separate / bound, batch_sum / std::max(batch_n, 1.0));
  nlohmann::json out = {{"mode", "batched"},
                        {"sessions", s_count},
                        {"prompt", o.prompt},
                        {"prompt_max", std::max(o.prompt, o.prompt_max)},
                        {"kept_tokens_mean", kept},
                        {"embed", o.embed},
                        {"dtype", layer.dtype},
                        {"cpu_class", attnserve_bench::CpuClass()},
                        {"read_gb_s", bandwidth},
                        {"threads", threads},
                        {"bytes_per_step", bytes_batched},
                        {"bound_steps_per_s", bound},
                        {"batched",
                         {{"steps_per_s", batched},
                          {"p50_ms", Percentile(batched_ms, 0.5)},
                          {"server_queue_p50_ms", Percentile(server_queue_ms, 0.5)},
                          {"server_compute_p50_ms", Percentile(server_compute_ms, 0.5)}}},
                        {"separate",
                         {{"steps_per_s", separate},
                          {"p50_ms", Percentile(separate_ms, 0.5)},
                          {"mean_batch", batch_sum / std::max(batch_n, 1.0)}}}};
  if (engine) {
    const double rate = Percentile(engine_rate, 0.5);
    std::printf("%-34s %12.0f %10.2f %10.2f %10.2f\n", "in-process engine (batched)", rate,
                Percentile(engine_ms, 0.5), Percentile(engine_ms, 0.9), rate / bound);
    out["in_process"] = {{"steps_per_s", rate},
                         {"p50_ms", Percentile(engine_ms, 0.5)},
                         {"kernels", engine->kernels()},
                         {"server_batched_ratio", Percentile(to_engine, 0.5)}};
    std::printf(
        "server batched / in-process: %.2f (the median repeat's; each repeat's rounds "
        "alternate)\n",
        Percentile(to_engine, 0.5));
  }
  out["separate"]["batched_ratio"] = Percentile(to_separate, 0.5);
  out["batched"]["bound_ratio"] = Percentile(to_bound, 0.5);
  if (o.micro_batches > 0) {
    out["pipelined"] = {{"micro_batches", std::clamp(o.micro_batches, 1, s_count)},
                        {"steps_per_s", Percentile(pipelined_rate, 0.5)},
                        {"p50_ms", Percentile(pipelined_ms, 0.5)},
                        {"bound_ratio", Percentile(pipelined_to_bound, 0.5)},
                        {"separate_ratio", Percentile(pipelined_to_separate, 0.5)}};
    std::printf(
        "micro-batches on a stream / separate: %.2f   / memory bound: %.2f (each the median "
        "repeat's)\n",
        Percentile(pipelined_to_separate, 0.5), Percentile(pipelined_to_bound, 0.5));
  }
  std::printf(
      "batched / separate: %.2f   batched / memory bound: %.2f (each the median repeat's)\n",
      Percentile(to_separate, 0.5), Percentile(to_bound, 0.5));
  WriteJson(o, out);
  return 0;
}

// ---- eviction
// --------------------------------------------------------------------------------------

int Eviction(const Options& o) {
  auto stub = pb::AttentionService::NewStub(Channel(o));
  const auto encoder = Tokens(o.memory_length, o.embed, 4);
  const auto query = Tokens(1, o.embed, 5);
  std::vector<std::string> handles;
  std::vector<double> create_ms;
  int64_t held = 0;
  for (int i = 0; i < o.memories; ++i) {
    pb::CreateMemoryRequest create;
    create.set_model(o.model);
    SetTensor(encoder, 0, o.memory_length, o.embed, create.mutable_key());
    *create.mutable_value() = create.key();
    pb::KvHandle memory;
    const Call c = Timed(stub.get(), &Stub::CreateMemory, create, &memory);
    if (!c.status.ok()) Fail("CreateMemory " + std::to_string(i + 1), c.status);
    handles.push_back(memory.handle());
    create_ms.push_back(c.ms);
    held = memory.bytes();
  }
  // Newest first: a query renews its memory, so asking the oldest first could evict nothing more.
  int kept = 0, evicted = 0;
  std::map<std::string, int> other;
  std::string evicted_message;
  for (int i = o.memories - 1; i >= 0; --i) {
    pb::AttendRequest a;
    a.set_memory(handles[static_cast<size_t>(i)]);
    SetTensor(query, 0, 1, o.embed, a.mutable_query());
    pb::AttendResponse r;
    const Call c = Timed(stub.get(), &Stub::Attend, a, &r);
    if (c.status.ok()) {
      ++kept;
    } else if (c.status.error_code() == grpc::StatusCode::NOT_FOUND &&
               c.status.error_message().find("evicted") != std::string::npos) {
      ++evicted;
      evicted_message = c.status.error_message();
    } else {
      ++other[std::to_string(c.status.error_code()) + " " + c.status.error_message()];
    }
  }
  std::printf(
      "eviction: %d memories of %d tokens (%lld bytes each on the server) created one after "
      "another\n",
      o.memories, o.memory_length, static_cast<long long>(held));
  std::printf(
      "  CreateMemory p50 %.2f ms, p99 %.2f ms; afterwards %d answer, %d are NOT_FOUND (evicted), "
      "%zu other\n",
      Percentile(create_ms, 0.5), Percentile(create_ms, 0.99), kept, evicted, other.size());
  if (!evicted_message.empty()) std::printf("  e.g. \"%s\"\n", evicted_message.c_str());
  for (const auto& [what, n] : other) std::printf("  other: %d x %s\n", n, what.c_str());
  WriteJson(o, {{"mode", "eviction"},
                {"memories", o.memories},
                {"bytes_each", held},
                {"kept", kept},
                {"evicted", evicted},
                {"create_p50_ms", Percentile(create_ms, 0.5)},
                {"create_p99_ms", Percentile(create_ms, 0.99)}});
  for (int i = 0; i < o.memories;
       ++i) {  // Leave the server as found; evicted ones are already gone.
    pb::ReleaseRequest request;
    request.set_handle(handles[static_cast<size_t>(i)]);
    pb::ReleaseResponse response;
    Timed(stub.get(), &Stub::DeleteMemory, request, &response);
  }
  return other.empty() ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attnserve-kv-bench: sessions and memories versus resending keys and values"};
  Options o;
  std::string mode;
  app.add_option("mode", mode,
                 "decode | memory | concurrent | eviction | speculative | beam | fork | batched")
      ->required()
      ->check(CLI::IsMember({"decode", "memory", "concurrent", "eviction", "speculative", "beam",
                             "fork", "batched"}));
  app.add_option("--target", o.target, "attnserve address")->capture_default_str();
  app.add_option("--model", o.model, "Model (its embed_dim must be --embed)")
      ->capture_default_str();
  app.add_option("--embed", o.embed, "The model's embed_dim")->capture_default_str();
  app.add_option("--steps", o.steps,
                 "decode: tokens decoded; memory: queries; concurrent: steps per caller; "
                 "speculative: tokens accepted; beam: steps")
      ->capture_default_str();
  app.add_option("--repeats", o.repeats,
                 "decode: sequences decoded (per-step medians over them); fork: forks")
      ->capture_default_str();
  app.add_option("--memory-length", o.memory_length, "memory, eviction: encoder tokens")
      ->capture_default_str();
  app.add_option("--callers", o.callers, "concurrent: callers; batched: sessions")
      ->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches,
                 "batched: also step the sessions as this many micro-batches (split evenly), each "
                 "a batched step, all in flight on one AttendStream (0: not)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--threads", o.threads,
                 "batched: threads of the read-bandwidth measurement and of the in-process engine "
                 "(0: every core)")
      ->capture_default_str();
  app.add_option("--in-process", o.in_process,
                 "batched: also step the same shapes in this process on this model directory "
                 "(the model the server serves as --model)");
  app.add_option("--device", o.device, "batched --in-process: the engine's device (as --device)")
      ->capture_default_str();
  app.add_option("--dtype", o.dtype, "batched --in-process: the engine's dtype (as --dtype)")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}))
      ->capture_default_str();
  app.add_option("--prompt", o.prompt,
                 "concurrent: prompt tokens each sequence starts with; fork: the history (0: 2048)")
      ->capture_default_str();
  app.add_option("--prompt-max", o.prompt_max,
                 "concurrent: the callers' prompts spread evenly from --prompt up to this many "
                 "tokens (0: all --prompt)")
      ->capture_default_str();
  app.add_flag("--sessions-only", o.sessions_only,
               "concurrent: measure the sessions alone (resending long prefixes takes long)");
  app.add_flag("--stream", o.stream,
               "concurrent: each caller's steps as messages of one AttendStream (default: unary "
               "Attend calls)");
  app.add_flag("--async", o.async,
               "concurrent: every caller's unary steps driven from one thread through gRPC's "
               "asynchronous API (one completion queue), so that the load generator takes little "
               "of the cores it shares with the server (default: a thread per caller, blocking "
               "calls); not with --stream")
      ->excludes("--stream");
  app.add_option("--memories", o.memories, "eviction: memories created")->capture_default_str();
  app.add_option("--draft", o.draft, "speculative: draft tokens a round")->capture_default_str();
  app.add_option("--beams", o.beams, "beam: beams")->capture_default_str();
  app.add_option("--json", o.json, "Append one JSON line per result here");
  app.add_option("--csv", o.csv, "decode: per-step medians here");
  CLI11_PARSE(app, argc, argv);
  if (mode == "decode") return Decode(o);
  if (mode == "memory") return Memory(o);
  if (mode == "concurrent") return Concurrent(o);
  if (mode == "speculative") return Speculative(o);
  if (mode == "beam") return Beam(o);
  if (mode == "fork") return Fork(o);
  if (mode == "batched") return Batched(o);
  return Eviction(o);
}
