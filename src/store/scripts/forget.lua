-- forget: an operator who checked that a request whose outcome is unknown did not
-- take effect frees its key, so the next retry runs.
--
-- KEYS[1]  the record's store key
-- ARGV[1]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
--
-- Returns 1 when the record was removed, 0 when it is not unknown (completed, or in
-- flight with its lease running), -1 when there is no record.
--
-- Invariant: compare-and-set from "unknown": a record marked unknown, or in flight
-- with its lease run out (which reads as unknown). A completed record, or one whose
-- owner may still be writing, is never removed here.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local record = redis.call('HMGET', KEYS[1], 'state', 'lease')
if not record[1] then
  return -1
end

if record[1] == 'unknown' or (record[1] == 'in_flight' and tonumber(record[2]) <= now) then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[1], KEYS[1] .. ':w', 'released')
  return 1
end

return 0
