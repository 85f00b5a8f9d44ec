#pragma once
// The pipeline's calls on keys and values kept on the server (memories and sessions), as the
// services that offer them see it.

#include <functional>
#include <string>

#include "attnserve/v1/attention.pb.h"
#include "server/kv/kv_store.h"
#include "server/pipeline/calls.h"

namespace attnserve {

/// Memories and sessions: made, forked, cut back and ended. `traced`, when not null, receives the
/// call's trace (for a failure to name).
class KeptKv {
 public:
  virtual ~KeptKv() = default;
  /// Projects and keeps a memory; `done` runs once, on any thread, with `resp` filled when OK and
  /// the call's trace.
  virtual void CreateMemory(const v1::CreateMemoryRequest& req, CallContext call,
                            v1::KvHandle* resp,
                            std::function<void(const Status&, const CallTrace&)> done) = 0;
  /// Opens an empty decoding session.
  virtual Status OpenSession(const v1::OpenSessionRequest& req, v1::KvHandle* resp,
                             const KvCaller& caller, CallTrace* traced) = 0;
  /// ForkSession: the new session, or the store's refusal.
  virtual Status ForkSession(const v1::ForkSessionRequest& req, v1::KvHandle* resp,
                             const KvCaller& caller, CallTrace* traced) = 0;
  /// TruncateSession: the session after it, or the store's refusal.
  virtual Status TruncateSession(const v1::TruncateSessionRequest& req, v1::KvHandle* resp,
                                 const KvCaller& caller, CallTrace* traced) = 0;
  /// Ends a memory or a session (`method` is the metrics label).
  virtual Status Release(const char* method, KvKind kind, const v1::ReleaseRequest& req,
                         v1::ReleaseResponse* resp, const KvCaller& caller, CallTrace* traced) = 0;
};

}  // namespace attnserve
