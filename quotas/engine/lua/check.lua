-- check.lua: evaluate every limit on an agent's path and, only if all pass, charge them all.
--
-- KEYS (all share the org's hash tag, see quotas/engine/keys.py):
--   1  aq:{org}:org              org policy hash: v (version), t:TOOL (weight), m:MODEL ("in,out" nano-USD per 1K)
--   2  aq:{org}:a:AGENT          the agent's compiled policy (JSON, see quotas/engine/compile.py)
--   3..6  aq:{org}:s:LEVEL:NODE  counter state of org, team, user, agent (packed records, see lib.lua);
--                                read with the policy in one MGET
--   7  aq:{org}:r                reservations: id -> record
--   8  aq:{org}:rq               reservation queue: "pushed_ms:id", due (pushed + TTL) in the order pushed
--   9  aq:{org}:usage            usage stream (events: quotas/engine/usage.py)
--   10..13 aq:{org}:l:LEVEL:NODE lease zsets of org, team, user, agent (peek mode only: a check passes 9 keys)
-- ARGV:
--   1 mode         "check" (charge if all pass) or "peek" (consume nothing)
--   2 now_ms       "" to use the server's TIME (tests pass a fixed clock)
--   3 path         "org team user agent" the caller built KEYS from (checked against the policy)
--   4 tool         "" for none
--   5 model        "" for none
--   6 tokens       estimated tokens, 0..10^9
--   7 reservation  id for this check's reservation (check mode)
--   8 ttl_ms       how long the reservation waits for its settlement
--   9 sweep        how many overdue reservations to expire on the way (0 for none)
--   10 known       the policy version the caller has cached ("" for none)
-- Example:
--   FCALL aq_check_<version> 9 aq:{acme}:org aq:{acme}:a:agent-1 aq:{acme}:s:org:acme ... aq:{acme}:usage
--           check "" "acme eng alice agent-1" llm_call gpt-4o 2000 5f0c.eng.alice.agent-1 600000 2 1795290000000
-- Returns a flat array:
--   {status, version, policy, retry_ms, blocked, reservation, [index * 2 + passed, remaining, reset_ms] per limit}
--   status: "ok" | "deny" | "missing" (no org policy) | "unknown" (no such agent) | "stale" (path moved);
--   policy: the policy JSON when `known` is not its version ("" otherwise); retry_ms -1 = never;
--   blocked: 1-based position of the blocking limit among those returned (0 = none);
--   index: the limit's 1-based position in the policy's "l" list; passed: 1 or 0 (one number with the index:
--   each value of the reply costs the server about as much as a limit's arithmetic).

local mode, path_arg, tool, model = ARGV[1], ARGV[3], ARGV[4], ARGV[5]
local tokens = tonumber(ARGV[6])
local now, now_text = now_ms(ARGV[2])
assert(mode == 'check' or mode == 'peek', 'mode must be check or peek')
assert(tokens and tokens >= 0, 'tokens must be a number >= 0')

local org_policy = redis.call('HMGET', KEYS[1], 'v', 't:' .. tool, 'm:' .. model)
if not org_policy[1] then return {'missing'} end
-- The policy and the four nodes' counter state in one read (KEYS of a path not learnt yet are read,
-- never written: the answer is "stale" before they are used).
local got = redis.call('MGET', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
local blob = got[1]
if not blob then return {'unknown'} end
local policy = decode_policy(blob)  -- cached and shared between calls: its call-state tables are refilled
local p = policy.p
local fresh = policy.v == tonumber(ARGV[10]) and '' or blob  -- numbers: text of a big version has an exponent
if policy.path_text ~= path_arg then return {'stale', policy.v, blob} end

local weight, cost = call_cost(org_policy, tokens)
local states = {false, false, false, false}
local n, blocked, retry = decide(policy, states, KEYS, got, mode == 'peek', tool, model, tokens, weight, cost, now)

-- The reply (see the top), in the policy's own table.
local function reply(status, charged, reservation)
  local out = policy.reply
  out[1], out[2], out[3], out[4], out[5], out[6] = status, policy.v, fresh, retry, blocked, reservation or ''
  out[put_rows(out, 6, policy, n, charged) + 1] = nil  -- the reply ends at the first nil
  return out
end

if mode == 'peek' then return reply(blocked > 0 and 'deny' or 'ok', false) end

local sweep_n = tonumber(ARGV[9]) or 0
if sweep_n > 0 then sweep(KEYS[7], KEYS[8], KEYS[9], p[1], now, sweep_n, tonumber(ARGV[8])) end

if blocked > 0 then
  redis.call('XADD', KEYS[9], '*', 'e', deny_event(p, tool, model, now_text))
  return reply('deny', false)
end

-- Every limit passed: charge them all, and write each level's state back with one SET. The
-- reservation remembers which token and cost limits it charged: settle corrects those.
local m = charge_all(policy, n, now)
for level = 1, 4 do
  local st = states[level]
  if st and st.dirty then write_state(policy, level, now) end
end

local id, tokens_text, cost_text = ARGV[7], ARGV[6], cost > 0 and int(cost) or '0'
redis.call('HSET', KEYS[7], id, open_record(p, tool, model, tokens_text, cost_text, now_text, policy.charged, m))
redis.call('RPUSH', KEYS[8], now_text .. ':' .. id)
redis.call('XADD', KEYS[9], '*', 'e', check_event(p, tool, model, org_policy[2] or '1', tokens_text, cost_text, now_text, id))
return reply('ok', true, id)
