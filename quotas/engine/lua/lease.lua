-- lease.lua: concurrency slots. A lease takes a slot in every concurrency limit on the
-- agent's path at once, or in none; it expires by itself unless renewed.
--
-- KEYS (one org's hash tag):
--   1  aq:{org}:org              org policy hash (its absence means the policy is not loaded)
--   2  aq:{org}:a:AGENT          the agent's compiled policy
--   3..6  aq:{org}:l:LEVEL:NODE  lease zsets of org, team, user, agent: lease id -> expiry ms
-- ARGV:
--   1 op        "acquire", "renew" or "release"
--   2 now_ms    "" for the server's TIME
--   3 path      "org team user agent" the caller built KEYS from
--   4 lease     the lease's id
--   5 ttl_ms    lifetime from now (acquire, renew)
--   6 known     the policy version the caller has cached (acquire; "" for none)
-- Example:
--   FCALL aq_lease_<version> 6 aq:{acme}:org aq:{acme}:a:agent-1 aq:{acme}:l:org:acme ... acquire "" "acme eng alice agent-1" l1 300000
-- Returns, for acquire, check.lua's flat array with the lease's expiry (ms) in the reservation's place:
--   {"ok"|"full"|"missing"|"unknown"|"stale", version, policy, retry_ms, blocked, expiry, [index * 2 + passed, remaining, 0]...}
-- and for renew / release: {"ok", expiry} or {"gone"}.

local op, path_arg, lease = ARGV[1], ARGV[3], ARGV[4]
local now = now_ms(ARGV[2])
local ttl = tonumber(ARGV[5]) or 0
assert(op == 'acquire' or op == 'renew' or op == 'release', 'op must be acquire, renew or release')

if op == 'release' then
  local removed = 0
  for i = 3, 6 do removed = removed + redis.call('ZREM', KEYS[i], lease) end
  return {removed > 0 and 'ok' or 'gone'}
end

if op == 'renew' then
  local held = 0
  for i = 3, 6 do
    local score = redis.call('ZSCORE', KEYS[i], lease)
    if score and tonumber(score) > now then
      redis.call('ZADD', KEYS[i], now + ttl, lease)
      if redis.call('PTTL', KEYS[i]) < ttl + 1000 then redis.call('PEXPIRE', KEYS[i], ttl + 1000) end
      held = held + 1
    end
  end
  if held == 0 then return {'gone'} end
  return {'ok', now + ttl}
end

if not redis.call('HGET', KEYS[1], 'v') then return {'missing'} end
local blob = redis.call('GET', KEYS[2])
if not blob then return {'unknown'} end
local policy = decode_policy(blob)
local p = policy.p
if p[1] .. ' ' .. p[2] .. ' ' .. p[3] .. ' ' .. p[4] ~= path_arg then return {'stale', policy.v, blob} end
local fresh = policy.v == tonumber(ARGV[6]) and '' or blob

local rows, slots, blocked, retry = {}, {}, 0, 0
for i, lim in ipairs(policy.l) do
  if lim.m == 'concurrency' and active(lim, now) then
    local key = KEYS[2 + lim.lv]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)   -- leases not renewed in time free their slot
    local held = redis.call('ZCARD', key)
    local ok = held + 1 <= lim.a
    local n = #rows
    rows[n + 1] = ok and i * 2 + 1 or i * 2; rows[n + 2] = lim.a - held - (ok and 1 or 0); rows[n + 3] = 0
    if ok or lim.sh then
      slots[key] = true
    elseif blocked == 0 then
      local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
      blocked, retry = #rows / 3, math.max(1, tonumber(first[2]) - now)
    end
  end
end
local status, expiry = 'full', ''
if blocked == 0 then
  for key in pairs(slots) do
    redis.call('ZADD', key, now + ttl, lease)
    if redis.call('PTTL', key) < ttl + 1000 then redis.call('PEXPIRE', key, ttl + 1000) end  -- never shorten
  end
  status, expiry = 'ok', now + ttl
end
local out = {status, policy.v, fresh, retry, blocked, expiry}
for _, value in ipairs(rows) do out[#out + 1] = value end
return out
