-- check_batch.lua: several checks of one org in one call, each decided on its own, in order: every
-- check answers as check.lua would answer it, run right after the ones before it at the same `now`.
-- What the checks share is done once: TIME, the org's version and each tool's and model's fields,
-- each agent's policy, and each node's counter state, read once and written once (a node's records
-- stay unpacked in its policy while the same agent's checks follow one another; another agent's
-- check on the same node packs them for its own reading). Reservations go in with one HSET and one
-- RPUSH; each check has its own usage event. The sweep of overdue reservations runs once, before
-- the first check decided, for up to ARGV[3] of them.
--
-- KEYS (all share the org's hash tag, see quotas/engine/keys.py):
--   1  aq:{org}:org              org policy hash
--   2  aq:{org}:r                reservations
--   3  aq:{org}:rq               reservation queue
--   4  aq:{org}:usage            usage stream
--   then 5 per agent of the batch (agent g's at 5 * g .. 5 * g + 4): aq:{org}:a:AGENT, then the counter
--   state of its org, team, user and agent (aq:{org}:s:LEVEL:NODE), as check.lua's KEYS 2..6
-- ARGV:
--   1 now_ms        "" to use the server's TIME (tests pass a fixed clock)
--   2 ttl_ms        how long a reservation waits for its settlement
--   3 sweep         how many overdue reservations to expire on the way (0 for none)
--   4 agents        G, the number of agents
--   then 2 per agent (agent g's at 3 + 2 * g): path "org team user agent", known policy version ("" for none)
--   then 5 per check: agent g (1-based), tool ("" for none), model ("" for none), tokens, reservation id
-- Example (two checks of one agent):
--   FCALL aq_check_batch_<version> 9 aq:{acme}:org aq:{acme}:r aq:{acme}:rq aq:{acme}:usage aq:{acme}:a:agent-1
--           aq:{acme}:s:org:acme ... aq:{acme}:s:agent:agent-1
--           "" 600000 4 1 "acme eng alice agent-1" 1795290000000 1 llm_call gpt-4o 2000 5f0c.eng.alice.agent-1
--           1 web_search "" 0 9a1b.eng.alice.agent-1
-- Returns {"missing"} when the org has no policy; else, per check in order, 7 values and its rows:
--   status, version, policy, retry_ms, blocked, reservation, n, then n rows [index * 2 + passed, remaining, reset_ms]
--   as check.lua's reply (status "ok" | "deny" | "unknown" | "stale" | "skip"; all but the first two have n = 0).
--   The first "stale" check (an agent whose path the caller has not learnt, or has wrong) stops the
--   deciding: each later check answers "stale" too (with its policy) or "skip", and nothing of them is
--   charged, so that the caller, once it has learnt the paths, sends them again in their order.

local now, now_text = now_ms(ARGV[1])
local ttl_ms, sweep_n, agents = tonumber(ARGV[2]), tonumber(ARGV[3]) or 0, tonumber(ARGV[4])
local res_key, queue_key, stream_key = KEYS[2], KEYS[3], KEYS[4]
if not redis.call('HGET', KEYS[1], 'v') then return {'missing'} end

-- Counter state: a key's value is current[key] (false: no such key), unless the records of a policy
-- hold it (holder[key], at level held_at[key]): charged and not packed yet. ttl_of[key]: the TTL of
-- the last check that renewed the key (one by one, its SET ... PX is the last; later ones keep it).
local current, holder, held_at, ttl_of = {}, {}, {}, {}
local touched, marked, t = {}, {}, 0  -- the keys charged, in order
local function unhold(key)
  current[key], holder[key] = pack_state(holder[key], held_at[key]), nil
end

local read, org_fields = {}, {}           -- per agent: {keys, got, path, known}; per "tool|model": HMGET
local states = {false, false, false, false}
local out, k, opened, queued, events, h, swept, stopped = {}, 0, {}, {}, {}, 0, false, false
-- A check's 7 values before its rows (see the top), from out[k + 1] on; returns the last position written.
local function put_head(k, status, version, policy_text, retry, blocked, reservation, n)
  out[k + 1], out[k + 2], out[k + 3], out[k + 4], out[k + 5], out[k + 6], out[k + 7] =
    status, version, policy_text, retry, blocked, reservation, n
  return k + 7
end
local first = 4 + 2 * agents
for a = first, #ARGV - 1, 5 do
  local g, tool, model, tokens_text, id = tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local tokens = tonumber(tokens_text)
  local agent = read[g]
  if not agent then                       -- the agent's policy and its nodes' state, as check.lua reads them
    local b = 5 * g
    local keys = {KEYS[1], KEYS[b], KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4]}
    agent = {keys = keys, got = redis.call('MGET', KEYS[b], KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4]),
             path = ARGV[3 + 2 * g], known = tonumber(ARGV[4 + 2 * g])}
    for level = 1, 4 do                   -- what an earlier check of the batch left is newer
      local key = keys[2 + level]
      if current[key] == nil and not holder[key] then current[key] = agent.got[1 + level] end
    end
    read[g] = agent
  end
  local blob = agent.got[1]
  local policy = blob and decode_policy(blob)
  if not policy then
    k = put_head(k, 'unknown', 0, '', 0, 0, '', 0)
  elseif policy.path_text ~= agent.path then
    k = put_head(k, 'stale', policy.v, blob, 0, 0, '', 0)
    stopped = true
  elseif stopped then
    k = put_head(k, 'skip', 0, '', 0, 0, '', 0)
  else
    local p, keys, got = policy.p, agent.keys, agent.got
    local fields = org_fields[tool .. '|' .. model]
    if not fields then
      fields = redis.call('HMGET', KEYS[1], 'v', 't:' .. tool, 'm:' .. model)
      org_fields[tool .. '|' .. model] = fields
    end
    local weight, cost = call_cost(fields, tokens)
    for level = 1, 4 do                   -- the policy's records, if they hold the node; else its value now
      local key = keys[2 + level]
      if holder[key] == policy then
        states[level] = policy.states[level]
      else
        if holder[key] then unhold(key) end
        states[level], got[1 + level] = false, current[key]
      end
    end
    local n, blocked, retry = decide(policy, states, keys, got, false, tool, model, tokens, weight, cost, now)
    if not swept then
      swept = true
      if sweep_n > 0 then sweep(res_key, queue_key, stream_key, p[1], now, sweep_n, ttl_ms) end
    end
    local fresh = policy.v == agent.known and '' or blob
    local status, reservation, charged = 'deny', '', false
    if blocked > 0 then
      events[#events + 1] = deny_event(p, tool, model, now_text)
    else
      local m = charge_all(policy, n, now)
      for level = 1, 4 do
        local st = states[level]
        if st and st.dirty then
          local key = keys[2 + level]
          if st.renew then                -- this check's TTL; the next check of the node starts afresh
            ttl_of[key] = state_ttl(policy, level, now)
            st.renew, st.min_ttl = false, 0
          end
          if holder[key] ~= policy then
            if not marked[key] then t = t + 1; touched[t], marked[key] = key, true end
            holder[key], held_at[key] = policy, level
          end
        end
      end
      local cost_text = cost > 0 and int(cost) or '0'
      opened[h + 1], opened[h + 2] = id, open_record(p, tool, model, tokens_text, cost_text, now_text, policy.charged, m)
      h = h + 2
      queued[#queued + 1] = now_text .. ':' .. id
      events[#events + 1] = check_event(p, tool, model, fields[2] or '1', tokens_text, cost_text, now_text, id)
      status, reservation, charged = 'ok', id, true
    end
    k = put_rows(out, put_head(k, status, policy.v, fresh, retry, blocked, reservation, n), policy, n, charged)
  end
end

-- Nothing is written before every check is decided (an error on the way leaves no half batch; the
-- sweep before, like check.lua's, stands on its own): every node a check charged, once; the reservations,
-- in chunks (Lua's unpack has a limit); the usage events, in order.
for i = 1, t do
  local key = touched[i]
  if holder[key] then unhold(key) end
  store_state(key, current[key], ttl_of[key])
end
for from = 1, h, 1000 do redis.call('HSET', res_key, unpack_list(opened, from, min(h, from + 999))) end
for from = 1, #queued, 1000 do redis.call('RPUSH', queue_key, unpack_list(queued, from, min(#queued, from + 999))) end
for i = 1, #events do redis.call('XADD', stream_key, '*', 'e', events[i]) end
return out
