-- inspect: what a record holds, for an operator; never its body.
--
-- KEYS[1]  the record's store key
--
-- Returns {} when there is no record, else
--   {state, version, fingerprint, lease_remaining_ms, status, reason, ttl_ms, body_bytes}
-- with "" for a field the state does not have. lease_remaining_ms is in_flight only,
-- on the store's clock, and may be 0 or less: the lease has run out.
--
-- Read only: it changes nothing, not even the expiry.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local record = redis.call('HMGET', KEYS[1], 'state', 'fp', 'lease', 'status', 'reason', 'v')
if not record[1] then
  return {}
end

local lease = ''
if record[1] == 'in_flight' and record[3] then
  lease = string.format('%.0f', tonumber(record[3]) - now)
end

return {
  record[1],
  record[6] or '',
  record[2] or '',
  lease,
  record[4] or '',
  record[5] or '',
  tostring(redis.call('PTTL', KEYS[1])),
  tostring(redis.call('HSTRLEN', KEYS[1], 'body')),
}
