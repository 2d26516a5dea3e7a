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
-- Example:
--   EVALSHA sha 6 aq:{acme}:org aq:{acme}:a:agent-1 aq:{acme}:l:org:acme ... acquire "" "acme eng alice agent-1" l1 300000
-- Returns JSON {"s": "ok"|"full"|"gone"|"missing"|"unknown"|"stale", "exp" (expiry ms), "b" (blocking limit),
--   "ra" (ms until a slot frees), "lim": [...]}

local op, path_arg, lease = ARGV[1], ARGV[3], ARGV[4]
local now = now_ms(ARGV[2])
local ttl = tonumber(ARGV[5]) or 0
assert(op == 'acquire' or op == 'renew' or op == 'release', 'op must be acquire, renew or release')

if op == 'release' then
  local removed = 0
  for i = 3, 6 do removed = removed + redis.call('ZREM', KEYS[i], lease) end
  return cjson.encode({s = removed > 0 and 'ok' or 'gone'})
end

if op == 'renew' then
  local held = 0
  for i = 3, 6 do
    local score = redis.call('ZSCORE', KEYS[i], lease)
    if score and tonumber(score) > now then
      redis.call('ZADD', KEYS[i], now + ttl, lease)
      redis.call('PEXPIRE', KEYS[i], ttl + 1000)
      held = held + 1
    end
  end
  if held == 0 then return cjson.encode({s = 'gone'}) end
  return cjson.encode({s = 'ok', exp = now + ttl})
end

if not redis.call('HGET', KEYS[1], 'v') then return cjson.encode({s = 'missing'}) end
local blob = redis.call('GET', KEYS[2])
if not blob then return cjson.encode({s = 'unknown'}) end
local policy = cjson.decode(blob)
if table.concat(policy.p, ' ') ~= path_arg then return cjson.encode({s = 'stale', p = policy.p}) end

local slots, lim_out, blocked, retry = {}, {}, nil, 0
for _, lim in ipairs(policy.l) do
  if lim.m == 'concurrency' and active(lim, now) then
    local key = KEYS[2 + lim.lv]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)   -- leases not renewed in time free their slot
    local held = redis.call('ZCARD', key)
    local ok = held + 1 <= lim.a
    lim_out[#lim_out + 1] = {lim.id, lim.lv, lim.m, int(lim.a), 0, '', '', '', '', lim.sh and 1 or 0,
      int(lim.a - held - (ok and 1 or 0)), 0, ok and 1 or 0}
    if ok or lim.sh then
      slots[key] = true
    elseif blocked == nil then
      local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
      blocked, retry = #lim_out, math.max(1, tonumber(first[2]) - now)
    end
  end
end
if blocked then return cjson.encode({s = 'full', b = blocked, ra = retry, lim = lim_out}) end
for key in pairs(slots) do
  redis.call('ZADD', key, now + ttl, lease)
  redis.call('PEXPIRE', key, ttl + 1000)
end
return cjson.encode({s = 'ok', exp = now + ttl, lim = lim_out})
