-- defer_probe: a probe learned nothing (another status, a timeout, a refused
-- connection); its lease ends, and the next probe is due `every` from now.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  the claim the probe was about: its owner token (32 hex digits)
-- ARGV[2]  the route's probe interval, `every`, in ms
--
-- Returns 1 when the next probe is scheduled, -3 when it would begin past the probe's
-- give_up_after and the probe has given up instead, 0 when the record is no longer
-- unknown for that claim (resolved meanwhile, or gone).
--
-- Invariant: changes only the schedule of a record unknown for the claim named; the
-- fingerprint, owner, reason, expiry and `/keep` are kept. A probe that has given up stays so.
local record = redis.call('GET', KEYS[1])
if not record or string.sub(record, 1, 2) ~= '2U' or string.sub(record, 67, 98) ~= ARGV[1] then
  return 0
end

local rest, keep = string.match(string.sub(record, 99), '^(.-)(/%d+)$')
if not rest then
  rest, keep = string.sub(record, 99), ''
end
local reason, due, give_up = string.match(rest, '^([%l-]+):(-?%d+):(-?%d+)$')
if not reason then
  return 0
end

local next_due = redis.call('PTTL', KEYS[1]) - tonumber(ARGV[2])
local result = 1
if tonumber(due) < 0 or next_due <= tonumber(give_up) then
  next_due, result = -1, -3
else
  next_due = math.max(next_due, 0)
end
redis.call('SET', KEYS[1], '2U' .. string.sub(record, 3, 98) .. reason .. ':' .. next_due .. ':' .. give_up .. keep, 'KEEPTTL')
return result
