-- complete: record the upstream's response on the claimant's in-flight record.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  the owner token the claim was made with (32 hex digits)
-- ARGV[2]  the response: status (3 digits), headers' length, ':', headers, body
-- ARGV[3]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
--
-- Returns 1 when the record was completed, 0 when it was fenced off.
--
-- Invariant: compare-and-set. Only the owner of a record that is still in flight,
-- and whose lease still holds, may complete it; anything else is refused, so a late
-- writer can never clobber a record that another request owns or that already reads
-- as unknown. The lease has run out once the record's remaining TTL (the store's own
-- clock) is at most the rest of `remember` the claim wrote. The expiry is kept. A
-- record that outlives its response (its claim wrote `/keep`) keeps the status and
-- the completion time, and the response goes beside it, in `<key>:r`, to expire by
-- itself once the record's TTL reaches `keep`: the end of the retention.
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 2) ~= '2F' or string.sub(record, 67, 98) ~= ARGV[1] then
  return 0
end

local rest, keep = string.match(string.sub(record, 99), '^(%d+)/?(%d*)$')
local pttl = redis.call('PTTL', KEYS[1])
if not rest or pttl <= tonumber(rest) then
  return 0
end

if keep == '' then
  redis.call('SET', KEYS[1], '2C' .. string.sub(record, 3, 66) .. ARGV[2], 'KEEPTTL')
else
  local now = redis.call('TIME')
  local completed_at = string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
  redis.call('SET', KEYS[1], '2K' .. string.sub(record, 3, 66) .. string.match(ARGV[2], '^%d%d%d') .. completed_at, 'KEEPTTL')
  local kept = pttl - tonumber(keep)
  if kept > 0 then
    redis.call('SET', KEYS[1] .. ':r', ARGV[2], 'PX', kept)
  end
end
redis.call(ARGV[3], KEYS[1] .. ':w', 'completed')
return 1
