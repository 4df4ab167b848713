-- wrk script for bench/policies.py: POSTs the workload's request bodies (one JSON object per
-- line of the file named by WRK_BODIES) to /v1/completions, non-streamed, each thread starting
-- at its own offset of the list; counts generated tokens (usage.completion_tokens) and non-200
-- answers, and prints them with the latency percentiles as WRK_ lines bench/policies.py parses.
local threads = {}
local counter = 0

function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
  table.insert(threads, thread)
end

function init(args)
  bodies = {}
  for line in io.lines(os.getenv("WRK_BODIES")) do
    bodies[#bodies + 1] = line
  end
  tokens, errors = 0, 0
  index = id * math.floor(#bodies / 2)
end

function request()
  index = index + 1
  local body = bodies[(index - 1) % #bodies + 1]
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end

function response(status, headers, body)
  if status ~= 200 then
    errors = errors + 1
    return
  end
  local n = body:match('"completion_tokens":%s*(%d+)')
  if n then tokens = tokens + tonumber(n) end
end

function done(summary, latency, requests)
  local t, e = 0, 0
  for _, thread in ipairs(threads) do
    t = t + thread:get("tokens")
    e = e + thread:get("errors")
  end
  io.write(string.format("WRK_RESULT tokens=%d errors=%d requests=%d duration_us=%d\n",
                         t, e + summary.errors.status + summary.errors.timeout, summary.requests, summary.duration))
  io.write(string.format("WRK_LATENCY p50_us=%d p99_us=%d\n", latency:percentile(50), latency:percentile(99)))
end
