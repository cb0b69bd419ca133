-- mark_unknown: the claimant forwarded its request but could not learn the outcome.
--
-- KEYS[1]  the record's store key
-- ARGV[1]  the owner token the claim was made with
-- ARGV[2]  the reason (upstream-timeout, upstream-failed, response-too-large)
-- ARGV[3]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
--
-- Returns 1 when the record became unknown, 0 when it was fenced off.
--
-- Invariant: compare-and-set on the owner token and the in_flight state. The lease
-- does not matter here: an expired lease already reads as unknown, and this only
-- says why. The expiry is never touched.
local record = redis.call('HMGET', KEYS[1], 'state', 'owner')
if record[1] ~= 'in_flight' or record[2] ~= ARGV[1] then
  return 0
end

redis.call('HSET', KEYS[1], 'state', 'unknown', 'reason', ARGV[2])
redis.call('HDEL', KEYS[1], 'lease')
redis.call(ARGV[3], KEYS[1] .. ':w', 'unknown')
return 1
