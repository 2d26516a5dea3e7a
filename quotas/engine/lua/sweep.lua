-- sweep.lua: expire an org's reservations whose settlement did not come in time. Each counts
-- at its estimate and is reported once as an unsettled usage event; old records are deleted.
-- (check.lua also sweeps a few on its way; this catches orgs that went quiet.)
--
-- KEYS (one org's hash tag):
--   1 aq:{org}:r       open reservations: id -> record
--   2 aq:{org}:rq      reservation queue ("pushed_ms:id", due in the order pushed)
--   3 aq:{org}:usage   usage stream
-- ARGV:
--   1 now_ms         "" for the server's TIME
--   2 org            the org's id, for the usage events
--   3 batch          how many to look at, at most
--   4 ttl_ms         the reservation TTL (an expired record is kept as long, to answer a late settlement)
-- Example: FCALL aq_sweep_<version> 3 aq:{acme}:r aq:{acme}:rq aq:{acme}:usage "" acme 500 600000
-- Returns the number of reservations expired.

local now = now_ms(ARGV[1])
return sweep(KEYS[1], KEYS[2], KEYS[3], ARGV[2], now, tonumber(ARGV[3]), tonumber(ARGV[4]))
