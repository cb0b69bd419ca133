-- claim: create an in-flight record, or report the one that exists.
--
-- KEYS[1]  the record's store key (one hash)
-- ARGV[1]  the claimant's owner token (32 hex chars)
-- ARGV[2]  the request fingerprint (64 hex chars)
-- ARGV[3]  retention, in milliseconds
-- ARGV[4]  lease, in milliseconds
-- ARGV[5]  the record format version this proxy writes (record::FORMAT_VERSION)
--
-- Returns one of
--   {"acquired"}
--   {"in_flight", version, fingerprint, lease_remaining_ms}
--   {"lease_expired", version, fingerprint}
--   {"completed", version, fingerprint, status, headers, body}
--   {"unknown", version, fingerprint, reason}
-- where version is the format the existing record was written in ("" if none).
--
-- Invariant: the expiry is set here, once, when the record is created (now +
-- retention, on the store's clock); an existing record is never changed. A claim
-- that finds its own live in-flight record counts as acquired, so retrying a claim
-- after a timeout is safe. An expired lease reads as lease_expired, never as free.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local record = redis.call('HMGET', KEYS[1], 'state', 'owner', 'fp', 'lease', 'status', 'headers', 'body', 'reason', 'v')
local state = record[1]

if not state then
  redis.call('HSET', KEYS[1],
    'v', ARGV[5],
    'state', 'in_flight',
    'owner', ARGV[1],
    'fp', ARGV[2],
    'lease', string.format('%.0f', now + tonumber(ARGV[4])))
  redis.call('PEXPIREAT', KEYS[1], string.format('%.0f', now + tonumber(ARGV[3])))
  return {'acquired'}
end

local version = record[9] or ''

if state == 'in_flight' then
  local remaining = tonumber(record[4]) - now
  if remaining <= 0 then
    return {'lease_expired', version, record[3]}
  end
  if record[2] == ARGV[1] then
    return {'acquired'}
  end
  return {'in_flight', version, record[3], string.format('%.0f', remaining)}
end

if state == 'completed' then
  return {'completed', version, record[3], record[5], record[6], record[7]}
end

return {'unknown', version, record[3], record[8]}
