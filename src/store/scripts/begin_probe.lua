-- begin_probe: takes the probe lease of a record whose outcome is unknown, if its
-- probe is due, so that the caller may ask the upstream what became of it.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  the probe lease, in ms: no other probe of this record begins before it ends
-- ARGV[2]  the route's give_up_after, in ms: for a record no probe was scheduled for
--
-- Returns {code, claim, wait}: {1, owner, 0} when the lease is the caller's, for the
-- claim `owner` (32 hex digits) whose outcome is unknown; {2, '', ms} when the probe
-- is not due for `ms` (leased by another, or scheduled later); {-3, '', 0} when it has
-- given up; {0, '', 0} when there is nothing to probe (completed, in flight with its
-- lease running, or unknown without a claim to fence on); {-1, '', 0} when there is
-- no record.
--
-- Invariant: compare-and-set on the schedule the record keeps (see mark_unknown.lua):
-- the lease is taken only when the next probe is due, and taking it moves the next
-- due time past the lease, so two instances never probe one record at once. A record
-- in flight past its lease (its owner died) becomes unknown for 'lease-expired', its
-- owner kept. A probe that was due past give_up_after gives up instead. Nothing else
-- of the record changes: fingerprint, owner, reason, expiry and `/keep` are kept.
local record = redis.call('GET', KEYS[1])
if not record then
  return {-1, '', 0}
end

local pttl = redis.call('PTTL', KEYS[1])
local lease = tonumber(ARGV[1])
local tag = string.sub(record, 1, 2)
-- What follows the owner, and the `/keep` it may end with (kept as it is).
local rest, keep = string.match(string.sub(record, 99), '^(.-)(/%d+)$')
if not rest then
  rest, keep = string.sub(record, 99), ''
end
if tag == '2F' then
  if pttl > tonumber(rest) then
    return {0, '', 0}
  end
  local schedule = ':' .. math.max(pttl - lease, 0) .. ':' .. (pttl - tonumber(ARGV[2]))
  redis.call('SET', KEYS[1], '2U' .. string.sub(record, 3, 98) .. 'lease-expired' .. schedule .. keep, 'KEEPTTL')
  return {1, string.sub(record, 67, 98), 0}
end
if tag ~= '2U' then
  return {0, '', 0}
end

-- A record written before unknown records kept their owner has its reason there.
local owner = string.sub(record, 67, 98)
if #owner ~= 32 or string.find(owner, '%X') then
  return {0, '', 0}
end

local reason, due, give_up = string.match(rest, '^([%l-]+):(-?%d+):(-?%d+)$')
if not reason then
  -- Unknown with no probe scheduled (the route had none then): scheduled from now.
  reason, give_up = rest, pttl - tonumber(ARGV[2])
else
  due, give_up = tonumber(due), tonumber(give_up)
  if due < 0 then
    return {-3, '', 0}
  end
  if pttl > due then
    return {2, '', pttl - due}
  end
  if pttl <= give_up then
    redis.call('SET', KEYS[1], '2U' .. string.sub(record, 3, 98) .. reason .. ':-1:' .. give_up .. keep, 'KEEPTTL')
    return {-3, '', 0}
  end
end
redis.call('SET', KEYS[1], '2U' .. string.sub(record, 3, 98) .. reason .. ':' .. math.max(pttl - lease, 0) .. ':' .. give_up .. keep, 'KEEPTTL')
return {1, owner, 0}
