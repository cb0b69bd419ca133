-- mark_unknown: the claimant forwarded its request but could not learn the outcome.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  the owner token the claim was made with (32 hex digits)
-- ARGV[2]  the reason (upstream-timeout, upstream-failed, response-too-large, ...)
-- ARGV[3]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
-- ARGV[4]  on a route with a probe: its first_after, in ms; absent otherwise
-- ARGV[5]  with ARGV[4]: the probe's give_up_after, in ms
--
-- Returns 1 when the record became unknown, 0 when it was fenced off.
--
-- Invariant: compare-and-set on the owner token and the in-flight state. The lease
-- does not matter here: an expired lease already reads as unknown, and this only
-- says why. The fingerprint, the owner (what a resolution is fenced on) and the
-- expiry are kept, and so is `/keep` (the TTL at which a response recorded by a
-- resolution would expire). A probe's schedule is kept as the TTLs at which the next
-- probe is due and at which it gives up, on Redis's clock like the lease.
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 2) ~= '2F' or string.sub(record, 67, 98) ~= ARGV[1] then
  return 0
end

local tail = ARGV[2]
if ARGV[4] then
  local pttl = redis.call('PTTL', KEYS[1])
  tail = tail .. ':' .. math.max(pttl - tonumber(ARGV[4]), 0) .. ':' .. (pttl - tonumber(ARGV[5]))
end
local keep = string.match(string.sub(record, 99), '/%d+$') or ''
redis.call('SET', KEYS[1], '2U' .. string.sub(record, 3, 98) .. tail .. keep, 'KEEPTTL')
redis.call(ARGV[3], KEYS[1] .. ':w', 'unknown')
return 1
