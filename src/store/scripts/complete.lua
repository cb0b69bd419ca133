-- complete: record the upstream's response on the claimant's in-flight record.
--
-- KEYS[1]  the record's store key
-- ARGV[1]  the owner token the claim was made with
-- ARGV[2]  the response status code
-- ARGV[3]  the response headers, encoded by store::encode_headers
-- ARGV[4]  the response body
-- ARGV[5]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
--
-- Returns 1 when the record was completed, 0 when it was fenced off.
--
-- Invariant: compare-and-set. Only the owner of a record that is still in flight,
-- and whose lease still holds, may complete it; anything else is refused, so a late
-- writer can never clobber a record that another request owns or that already reads
-- as unknown. The expiry is never touched.
local record = redis.call('HMGET', KEYS[1], 'state', 'owner', 'lease')
if record[1] ~= 'in_flight' or record[2] ~= ARGV[1] then
  return 0
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
if now >= tonumber(record[3]) then
  return 0
end

redis.call('HSET', KEYS[1], 'state', 'completed', 'status', ARGV[2], 'headers', ARGV[3], 'body', ARGV[4])
redis.call('HDEL', KEYS[1], 'lease')
redis.call(ARGV[5], KEYS[1] .. ':w', 'completed')
return 1
