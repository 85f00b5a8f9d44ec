#pragma once
// A throw turned into a Status, where a call must end on every path (issue 48: a request whose
// decoding threw std::bad_alloc was never finished, and the server's stop then waited on it).

#include <exception>
#include <new>
#include <string>

#include "server/core/status.h"

namespace attnserve {

/// What `fn` (returning a Status) returns, or what it threw as a Status: std::bad_alloc is
/// RESOURCE_EXHAUSTED ("`what`: the server ran out of memory ..."), any other exception INTERNAL
/// naming it. For the steps of a call that allocate what the caller sized (decoding, reading
/// regions), so that the call is answered and counted ended whatever happens.
template <typename Fn>
Status Caught(const std::string& what, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kResourceExhausted,
                  what +
                      ": the server ran out of memory taking this request in (nothing was "
                      "computed); retry later or send a smaller one");
  } catch (const std::exception& e) {
    return Internal(what + ": " + e.what());
  } catch (...) {
    return Internal(what + ": an unknown exception");
  }
}

}  // namespace attnserve
