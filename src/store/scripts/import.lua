-- import: write a record moved from another store (`store copy`, `[store.previous]`;
-- see store/moving.rs), only where the key holds none.
--
-- KEYS[1]  the record's store key (a string: see store/redis/layout.rs)
-- ARGV[1]  the record's value, as the layout writes it
-- ARGV[2]  its PTTL: what is left of its life in the store it came from
-- ARGV[3]  the response kept beside it (`<key>:r`, in its slot), or '' for none
-- ARGV[4]  that response's PTTL
-- ARGV[5]  the owner token (32 hex digits) of an in-flight claim the record may
--          replace (the claim a `[store.previous]` lookup made), or '' for none
-- ARGV[6]  PUBLISH, or SPUBLISH on a cluster: how waiters are told
--
-- Returns 1 when the record was written, 0 when the key held one (kept as it is).
--
-- Invariant: a record is never overwritten, except the in-flight claim ARGV[5] names,
-- which nobody has forwarded yet (its owner is the caller).
local record = redis.call('GET', KEYS[1])
if record then
  if ARGV[5] == '' or string.sub(record, 1, 2) ~= '2F' or string.sub(record, 67, 98) ~= ARGV[5] then
    return 0
  end
end

redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[1] .. ':r', ARGV[3], 'PX', ARGV[4])
else
  redis.call('DEL', KEYS[1] .. ':r')
end
if record then
  redis.call(ARGV[6], KEYS[1] .. ':w', 'imported')
end
return 1
