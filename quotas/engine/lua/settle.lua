-- settle.lua: charge a reservation's actual tokens and cost, refunding (or adding) the
-- difference to every limit its check charged. Settling twice changes nothing.
--
-- KEYS (one org's hash tag):
--   1  aq:{org}:org              org policy hash (m:MODEL prices)
--   2  aq:{org}:a:AGENT          the agent's compiled policy (window and bucket sizes by limit id)
--   3..6  aq:{org}:s:LEVEL:NODE  counter state of org, team, user, agent (the path at check time)
--   7  aq:{org}:r                open reservations: id -> record
--   8  aq:{org}:rq               reservation queue
--   9  aq:{org}:usage            usage stream
-- ARGV:
--   1 now_ms          "" for the server's TIME
--   2 reservation     its id
--   3 input_tokens
--   4 output_tokens
--   5 ttl_ms          the reservation TTL: a settled record is kept this long to answer repeats
--   6 org             the org's id, for the usage event
-- Example:
--   FCALL aq_settle_<version> 9 aq:{acme}:org aq:{acme}:a:agent-1 ... aq:{acme}:usage "" r1.eng.alice.agent-1 1200 640 600000 acme
-- Returns JSON {"s": "settled"|"repeat"|"expired"|"unknown", "tokens", "cost", "est_tokens", "est_cost"}
-- (numbers as text: cost in nano-USD).

local now, now_text = now_ms(ARGV[1])
local id = ARGV[2]
local input, output = tonumber(ARGV[3]), tonumber(ARGV[4])
assert(input and input >= 0 and output and output >= 0, 'token counts must be numbers >= 0')

local rec = redis.call('HGET', KEYS[7], id)
if not rec then return cjson.encode({s = 'unknown'}) end
local f = split(rec, '|')
if f[1] == 's' then return cjson.encode({s = 'repeat', tokens = f[2], cost = f[3], est_tokens = f[4], est_cost = f[5]}) end
if f[1] == 'x' then return cjson.encode({s = 'expired', est_tokens = f[2], est_cost = f[3]}) end

-- o|team|user|agent|tool|model|est_tokens|est_cost|checked_ms|charged limits (id,level;...)
local team, user, agent, tool, model = f[2], f[3], f[4], f[5], f[6]
local est_tokens, est_cost = tonumber(f[7]), tonumber(f[8])
local tokens = input + output
local cost = 0
local prices = redis.call('HGET', KEYS[1], 'm:' .. model)
if prices then
  local price_in, price_out = string.match(prices, '^(%d+),(%d+)$')
  cost = math.ceil((input * tonumber(price_in) + output * tonumber(price_out)) / 1000)
end
local actual = {tokens = tokens, cost = cost}

local policy = nil
local blob = redis.call('GET', KEYS[2])
if blob then policy = decode_policy(blob) end
local estimate = {tokens = est_tokens, cost = est_cost}
local checked = tonumber(f[9])
-- Correct each limit the check charged, with the policy in force now, on the nodes the check charged.
-- A level whose node is not the agent's now (the agent moved) is left alone: the current policy does
-- not describe that node's state.
local charged_path = {ARGV[6], team, user, agent}
local states = {}
for charge_text in string.gmatch(policy and f[10] or '', '[^;]+') do
  local c = split(charge_text, ',')                  -- limit id, level
  local level = tonumber(c[2])
  local rec = policy.p[level] == charged_path[level] and policy.by_id[level][c[1]]
  local lim = nil
  for _, candidate in ipairs(rec and rec.lims or {}) do   -- an override, or what it replaces: the one in force
    if active(candidate, now) then lim = candidate end
  end
  if lim then
    local delta = actual[lim.m] - estimate[lim.m]
    if delta ~= 0 then
      states[level] = states[level] or read_state(policy, level, KEYS[2 + level], now)
      adjust(states[level], lim, checked, delta, now)
    end
  end
end
for level in pairs(states) do write_state(policy, level, now) end

redis.call('HSET', KEYS[7], id, table.concat({'s', int(tokens), int(cost), int(est_tokens), int(est_cost), now_text}, '|'))
redis.call('RPUSH', KEYS[8], now_text .. ':' .. id)
redis.call('XADD', KEYS[9], '*', 'e', usage_event('settle', {ARGV[6], team, user, agent}, tool, model, '0', '0',
  int(tokens), int(input), int(output), int(cost), f[7], f[8], now_text, id, '0'))
return cjson.encode({s = 'settled', tokens = int(tokens), cost = int(cost), est_tokens = int(est_tokens),
  est_cost = int(est_cost)})
