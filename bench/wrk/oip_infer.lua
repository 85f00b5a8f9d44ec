-- wrk's script for bench/http_load.py: POSTs the infer bodies that script wrote (one file each,
-- named in BODIES_LIST, one path a line) to /v2/models/<model>/infer in turn, each connection
-- starting at its own place; prints one JSON line of what wrk measured when done.
-- usage: wrk -s bench/wrk/oip_infer.lua URL -- LIST MODEL CONTENT_TYPE
local requests = {}
local next_index = 0
local thread_count = 0

function setup(thread)
  thread:set("id", thread_count)
  thread_count = thread_count + 1
end

function init(args)
  local list, model, content_type = args[1], args[2], args[3]
  for path in io.lines(list) do
    local f = assert(io.open(path, "rb"))
    local body = f:read("*a")
    f:close()
    requests[#requests + 1] = wrk.format("POST", "/v2/models/" .. model .. "/infer",
                                         {["Content-Type"] = content_type}, body)
  end
  next_index = (id or 0) * 7
end

function request()
  next_index = next_index % #requests + 1
  return requests[next_index]
end

function done(summary, latency, requests_done)
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d, "p50_us": %g, "p90_us": %g, "p99_us": %g, "max_us": %g}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
