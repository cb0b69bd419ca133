-- mark_unknown: the claimant forwarded its request but could not learn the outcome.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  the owner token the claim was made with (32 hex digits)
-- ARGV[2]  the reason (upstream-timeout, upstream-failed, response-too-large)
-- ARGV[3]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
--
-- Returns 1 when the record became unknown, 0 when it was fenced off.
--
-- Invariant: compare-and-set on the owner token and the in-flight state. The lease
-- does not matter here: an expired lease already reads as unknown, and this only
-- says why. The fingerprint, the owner (what a resolution is fenced on) and the
-- expiry are kept.
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 2) ~= '2F' or string.sub(record, 67, 98) ~= ARGV[1] then
  return 0
end

redis.call('SET', KEYS[1], '2U' .. string.sub(record, 3, 98) .. ARGV[2], 'KEEPTTL')
redis.call(ARGV[3], KEYS[1] .. ':w', 'unknown')
return 1
