-- resolve: a record whose outcome is unknown is settled by what was learned of it
-- (an operator who checked with the upstream, or the route's probe): the operation
-- took effect, and this response becomes the record's; or it did not, and the key is
-- freed so that the next retry runs.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  PUBLISH, or SPUBLISH on a cluster: how waiters are told (the record's
--          channel, its key and ':w', is in the record's slot)
-- ARGV[2]  the claim whose outcome was learned: its owner token (32 hex digits), or
--          '' for whichever claim is unknown now (a call that names none)
-- ARGV[3]  applied: the response, as complete.lua takes it (status, headers' length,
--          ':', headers, body); not applied: absent
--
-- Returns 1 when the record was resolved, 0 when it is not unknown (completed, or in
-- flight with its lease running), -2 when it is unknown for another claim, -1 when
-- there is no record.
--
-- Invariant: compare-and-set from "unknown": a record marked unknown, or in flight
-- with its lease run out (which reads as unknown). A completed record, or one whose
-- owner may still be writing, is never changed here, so a probe and an operator
-- never both win; and, given a claim, it is fenced on it, so that what was learned
-- about one request never lands on a later claim of the key. The fingerprint and the expiry are
-- kept. A record that outlives its response (`/keep`) is completed as complete.lua
-- does it: the status and completion time in the record, the response beside it
-- until the record's TTL reaches `keep` (none, if it already has: spent at once).
local record = redis.call('GET', KEYS[1])
if not record then
  return -1
end

local tag = string.sub(record, 1, 2)
local pttl = redis.call('PTTL', KEYS[1])
-- What follows the owner, and the `/keep` it may end with.
local rest, keep = string.match(string.sub(record, 99), '^(.-)/(%d+)$')
if not rest then
  rest, keep = string.sub(record, 99), ''
end
if not (tag == '2U' or (tag == '2F' and pttl <= tonumber(rest))) then
  return 0
end

-- A record written before unknown records kept their owner has its reason there,
-- which no named claim matches.
if ARGV[2] ~= '' and string.sub(record, 67, 98) ~= ARGV[2] then
  return -2
end

-- Both branches tell the record's waiters, as every write that changes a record does,
-- so that no waiter's wake depends on which writer changed it. Here no test can see
-- it: a waiter waits only on a record in flight, leaves with a 409 once it reads as
-- unknown, and re-reads by itself at the lease's end, which is the earliest a record in
-- flight can be resolved. Kept for that uniformity (the memory store wakes alike).
if ARGV[3] and keep == '' then
  redis.call('SET', KEYS[1], '2C' .. string.sub(record, 3, 66) .. ARGV[3], 'KEEPTTL')
  redis.call(ARGV[1], KEYS[1] .. ':w', 'completed')
elseif ARGV[3] then
  local now = redis.call('TIME')
  local completed_at = string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
  redis.call('SET', KEYS[1], '2K' .. string.sub(record, 3, 66) .. string.match(ARGV[3], '^%d%d%d') .. completed_at, 'KEEPTTL')
  local kept = pttl - tonumber(keep)
  if kept > 0 then
    redis.call('SET', KEYS[1] .. ':r', ARGV[3], 'PX', kept)
  end
  redis.call(ARGV[1], KEYS[1] .. ':w', 'completed')
else
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[1], KEYS[1] .. ':w', 'released')
end
return 1
