"""Acknowledged entries leave their stream at once: a trim rides with every batch of XACKs.

A request's payload is of no use once its result is stored and its entry acknowledged, yet the
reclaimer's trim (``consumer.reclaimer``) runs only every few seconds to minutes, so a 64 MiB
request sat in Redis that long. ``TRIM_SCRIPT`` runs in the writer's pipeline right after the
XACKs and applies the reclaimer's rule at once: ``XTRIM MINID`` below the oldest entry still
pending, never past the group's last-delivered id. Only a prefix of the stream goes, never an
entry in the middle: ``XDEL`` of acknowledged entries would free them even behind an older entry
still running, but leaves tombstones that make Redis 7.0 report the group's lag as unknown (nil)
for as long as that older entry remains, and the lag is what admission, ``inferq lag`` and KEDA
read. So an acknowledged entry behind an older one still pending leaves with the next trim after
that one is acknowledged.
"""

from __future__ import annotations

TRIM_SCRIPT = """
-- KEYS[1]: a request stream. ARGV[1]: the consumer group. Returns the entries trimmed; 0 when
-- there is no stream or group (never an error: a trim must not fail the acks it rides with).
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if type(pending) ~= 'table' or pending.err then
  return 0
end
local floor = nil
if pending[1] > 0 then
  floor = pending[2]
else
  local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
  if type(groups) ~= 'table' or groups.err then
    return 0
  end
  for _, group in ipairs(groups) do
    local fields = {}
    for i = 1, #group, 2 do
      fields[group[i]] = group[i + 1]
    end
    if fields['name'] == ARGV[1] then
      local ms, seq = string.match(fields['last-delivered-id'], '^(%d+)-(%d+)$')
      if ms and fields['last-delivered-id'] ~= '0-0' then
        floor = ms .. '-' .. (tonumber(seq) + 1)
      end
    end
  end
end
if not floor then
  return 0
end
return redis.call('XTRIM', KEYS[1], 'MINID', floor)
"""
