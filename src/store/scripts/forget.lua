-- forget: an operator who checked that a request whose outcome is unknown did not
-- take effect frees its key, so the next retry runs.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
--
-- Returns 1 when the record was removed, 0 when it is not unknown (completed, or in
-- flight with its lease running), -1 when there is no record.
--
-- Invariant: compare-and-set from "unknown": a record marked unknown, or in flight
-- with its lease run out (which reads as unknown). A completed record, or one whose
-- owner may still be writing, is never removed here.
local record = redis.call('GET', KEYS[1])
if not record then
  return -1
end

local tag = string.sub(record, 1, 2)
if tag == '2U' or (tag == '2F' and redis.call('PTTL', KEYS[1]) <= tonumber(string.sub(record, 99))) then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[1], KEYS[1] .. ':w', 'released')
  return 1
end

return 0
