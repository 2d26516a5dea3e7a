-- check.lua: evaluate every limit on an agent's path and, only if all pass, charge them all.
--
-- KEYS (all share the org's hash tag, see quotas/engine/keys.py):
--   1  aq:{org}:org              org policy hash: v (version), t:TOOL (weight), m:MODEL ("in,out" nano-USD per 1K)
--   2  aq:{org}:a:AGENT          the agent's compiled policy (JSON, see quotas/engine/compile.py)
--   3..6  aq:{org}:c:LEVEL:NODE  counter hashes of org, team, user, agent
--   7..10 aq:{org}:l:LEVEL:NODE  lease zsets of org, team, user, agent (read in peek mode)
--   11 aq:{org}:r                open reservations: id -> record
--   12 aq:{org}:rp               reservation deadlines: id -> ms
--   13 aq:{org}:usage            usage stream
-- ARGV:
--   1 mode         "check" (charge if all pass) or "peek" (consume nothing)
--   2 now_ms       "" to use the server's TIME (tests pass a fixed clock)
--   3 path         "org team user agent" the caller built KEYS from (checked against the policy)
--   4 tool         "" for none
--   5 model        "" for none
--   6 tokens       estimated tokens, 0..10^9
--   7 reservation  id for this check's reservation (check mode)
--   8 ttl_ms       how long the reservation waits for its settlement
--   9 sweep        how many expired reservations to expire on the way (0 for none)
-- Example:
--   EVALSHA sha 13 aq:{acme}:org aq:{acme}:a:agent-1 aq:{acme}:c:org:acme ... aq:{acme}:usage
--           check "" "acme eng alice agent-1" llm_call gpt-4o 2000 r1.eng.alice.agent-1 600000 2
-- Returns JSON: {"s": "ok"|"deny"|"missing"|"unknown"|"stale", "now", "lim": [...], "b" (blocked index),
--   "ra" (retry ms, -1 never), "res", "p" (the policy's path, when stale)}

local mode, path_arg, tool, model = ARGV[1], ARGV[3], ARGV[4], ARGV[5]
local tokens = tonumber(ARGV[6])
local now = now_ms(ARGV[2])
assert(mode == 'check' or mode == 'peek', 'mode must be check or peek')
assert(tokens and tokens >= 0, 'tokens must be a number >= 0')

local org_policy = redis.call('HMGET', KEYS[1], 'v', 't:' .. tool, 'm:' .. model)
if not org_policy[1] then return cjson.encode({s = 'missing', now = now}) end
local blob = redis.call('GET', KEYS[2])
if not blob then return cjson.encode({s = 'unknown', now = now}) end
local policy = cjson.decode(blob)
local path = table.concat(policy.p, ' ')
if path ~= path_arg then return cjson.encode({s = 'stale', p = policy.p, now = now}) end

local weight = tonumber(org_policy[2]) or 1
local cost = 0
if org_policy[3] then
  local price_in, price_out = string.match(org_policy[3], '^(%d+),(%d+)$')
  cost = cost_nanos(tokens, math.max(tonumber(price_in), tonumber(price_out)))  -- the estimate uses the higher price
end
local amounts = {requests = 1, credits = weight, tokens = tokens, cost = cost}

-- The limits that apply to this call, grouped by level so each counter hash is read once.
local applies, by_level = {}, {{}, {}, {}, {}}
for _, lim in ipairs(policy.l) do
  if active(lim, now) and (lim.t == nil or lim.t == tool) and (lim.md == nil or lim.md == model)
      and (lim.m ~= 'concurrency' or mode == 'peek') then
    applies[#applies + 1] = lim
    local group = by_level[lim.lv]
    group[#group + 1] = lim
  end
end

local states = {}
for level = 1, 4 do
  local group = by_level[level]
  if #group > 0 then
    local fields = {}
    for i, lim in ipairs(group) do fields[i] = lim.id end
    local values = redis.call('HMGET', KEYS[2 + level], unpack(fields))
    for i, lim in ipairs(group) do states[lim] = values[i] end
  end
end

local results, blocked, retry = {}, nil, 0
for i, lim in ipairs(applies) do
  local r
  if lim.m == 'concurrency' then
    local held = redis.call('ZCOUNT', KEYS[6 + lim.lv], '(' .. now, '+inf')
    r = {used = held, remaining = lim.a - held, ok = held + 1 <= lim.a, retry = 0, reset = 0}
  else
    r = evaluate(lim, states[lim], amounts[lim.m], now)
  end
  results[i] = r
  if not r.ok and not lim.sh and lim.m ~= 'concurrency' then  -- leases gate runs, not calls
    -- the request passes once every blocking limit does: the latest of their retry times
    if blocked == nil or r.retry == NEVER or (retry ~= NEVER and r.retry > retry) then
      blocked, retry = i, r.retry
    end
  end
end

local function report(charged)
  local out = {}
  for i, lim in ipairs(applies) do
    local r = results[i]
    local remaining = r.remaining
    if charged then remaining = remaining - r.x end
    -- id, level, metric, amount, window ms, period, tool, model, burst, shadow, remaining, reset ms, passed
    out[i] = {lim.id, lim.lv, lim.m, int(lim.a), lim.w or 0, lim.p or '', lim.t or '', lim.md or '',
              lim.b and int(lim.b) or '', lim.sh and 1 or 0, int(remaining), r.reset, r.ok and 1 or 0}
  end
  return out
end

local p = policy.p
if mode == 'peek' then
  return cjson.encode({s = blocked and 'deny' or 'ok', now = now, lim = report(false), b = blocked, ra = retry})
end

local swept = 0
local sweep_n = tonumber(ARGV[9]) or 0
if sweep_n > 0 then swept = sweep(KEYS[11], KEYS[12], KEYS[13], p[1], now, sweep_n, tonumber(ARGV[8])) end

if blocked then
  redis.call('XADD', KEYS[13], '*', 'kind', 'deny', 'org', p[1], 'team', p[2], 'user', p[3], 'agent', p[4],
    'tool', tool, 'model', model, 'ts_ms', int(now))
  return cjson.encode({s = 'deny', now = now, lim = report(false), b = blocked, ra = retry})
end

-- Every limit passed: charge them all (shadow ones too, so they can report what they would block).
local writes, ttl = {{}, {}, {}, {}}, {0, 0, 0, 0}
local charges = {}
for i, lim in ipairs(applies) do
  local r = results[i]
  local level = lim.lv
  local w = writes[level]
  w[#w + 1] = lim.id
  w[#w + 1] = charged_state(lim, r, now)
  ttl[level] = math.max(ttl[level], horizon_ms(lim, now))
  if (lim.m == 'tokens' or lim.m == 'cost') and r.x > 0 then
    local where = lim.b and 0 or (lim.w and r.slot or r.start)
    charges[#charges + 1] = table.concat({lim.id, level, lim.m, int(where), int(r.x)}, ',')
  end
end
for level = 1, 4 do
  if #writes[level] > 0 then
    redis.call('HSET', KEYS[2 + level], unpack(writes[level]))
    redis.call('PEXPIRE', KEYS[2 + level], ttl[level] + 1000)
  end
end

local id, res_ttl = ARGV[7], tonumber(ARGV[8])
redis.call('HSET', KEYS[11], id, table.concat({'o', p[2], p[3], p[4], tool, model, int(tokens), int(cost), int(now),
  table.concat(charges, ';')}, '|'))
redis.call('ZADD', KEYS[12], now + res_ttl, id)
redis.call('XADD', KEYS[13], '*', 'kind', 'check', 'org', p[1], 'team', p[2], 'user', p[3], 'agent', p[4],
  'tool', tool, 'model', model, 'requests', '1', 'credits', int(weight), 'tokens', int(tokens),
  'cost_nanos', int(cost), 'ts_ms', int(now), 'reservation', id, 'unsettled', '0')
return cjson.encode({s = 'ok', now = now, lim = report(true), res = id, swept = swept})
