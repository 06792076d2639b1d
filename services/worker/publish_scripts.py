"""The worker's Lua scripts for publishing a step (publisher.py): what each writes and how it is fenced."""

from __future__ import annotations

from shared.wire.bus import LUA_XADD_EVENT

# KEYS: exec layers. The attempt each was placed with (nil: the context is gone).
ATTEMPTS_LUA = "local out = {} for i, k in ipairs(KEYS) do out[i] = redis.call('HGET', k, 'attempt') end return out"

# KEYS: a request's tokens list, its exec layer. ARGV: the attempt the worker holds it with, index of the first
# token in the output, the tokens..., ttl. A Redis Cluster's append (publisher._publish_fenced), one per request.
# Appends the tokens the list does not have yet, so a step published twice (its first try failed after some of
# its writes were made: a failover in the middle) appends nothing twice. Returns -1; or the list's length when it
# is shorter than the index (it lost its tail in a failover): the caller sends the missing tokens with its next
# step; or FENCED when exec.attempt moved on (the request was placed elsewhere): nothing written.
FENCED = -2
APPEND_LUA = """
if redis.call('HGET', KEYS[2], 'attempt') ~= ARGV[1] then return -2 end
local n = redis.call('LLEN', KEYS[1])
local at = tonumber(ARGV[2])
if n < at then return n end
for i = 3 + n - at, #ARGV - 1 do redis.call('RPUSH', KEYS[1], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[#ARGV])
return -1
"""

# KEYS: the step's tokens lists and exec layers, a pair per request, then its reply streams. ARGV: the requests'
# count, the lists' TTL; per request the attempt it is held with, the index of its first token, the count of its
# tokens, the tokens; per reply stream its event (shared.wire.bus.event_argv).
# A step's tokens on a single Redis, in one script (publisher._publish_transaction): fenced as a whole (a request
# placed elsewhere since, or whose context is gone, makes it write nothing and name those by position: the caller
# leaves them out and runs it again), each list appended from where it stands (as APPEND_LUA: a step sent twice
# appends nothing twice), then the reply events. Returns {'moved', positions...}, or {'ok', position, length, ...}
# naming the lists found shorter than their index.
TOKENS_LUA = """
local n, a = tonumber(ARGV[1]), 3
local moved = {'moved'}
for i = 1, n do
  if redis.call('HGET', KEYS[2 * i], 'attempt') ~= ARGV[a] then moved[#moved + 1] = i end
  a = a + 3 + tonumber(ARGV[a + 2])
end
if #moved > 1 then return moved end
local out = {'ok'}
a = 3
for i = 1, n do
  local list, at, last = KEYS[2 * i - 1], tonumber(ARGV[a + 1]), a + 2 + tonumber(ARGV[a + 2])
  local have = redis.call('LLEN', list)
  if have < at then
    out[#out + 1] = i
    out[#out + 1] = have
  else
    for j = a + 3 + have - at, last do redis.call('RPUSH', list, ARGV[j]) end
    redis.call('EXPIRE', list, ARGV[2])
  end
  a = last + 1
end
for k = 2 * n + 1, #KEYS do
  @XADD_EVENT
  a = a + 3
end
return out
""".replace("@XADD_EVENT", LUA_XADD_EVENT)
