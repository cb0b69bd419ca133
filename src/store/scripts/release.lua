-- release: remove a claim whose request never reached the upstream.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  the owner token the claim was made with (32 hex digits)
-- ARGV[2]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
--
-- Returns 1 when the record was removed, 0 when it was fenced off (absent, owned by
-- another request, or no longer in flight).
--
-- Invariant: compare-and-set on the owner token and the in-flight state, so only the
-- claimant can free its own key, and only while nothing has been recorded on it.
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 2) ~= '2F' or string.sub(record, 67, 98) ~= ARGV[1] then
  return 0
end

redis.call('DEL', KEYS[1])
redis.call(ARGV[2], KEYS[1] .. ':w', 'released')
return 1
