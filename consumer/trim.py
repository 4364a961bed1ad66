"""Trimming request streams: one rule, ``TRIM_SCRIPT``, run by the writer after its XACKs and by
the reclaimer's housekeeping; and ``TrimSchedule``, when the writer runs it.

The rule: ``XTRIM MINID`` below the oldest entry still pending, never past the group's
last-delivered id, so only a prefix that was delivered and acknowledged ever goes (``XDEL``
would leave tombstones that make Redis 7.0 report the group's lag as unknown). A trim costs more
commands than a request's own, so it rides with a stream's XACK only if that stream was not
trimmed in the last ``TRIM_INTERVAL_S``; otherwise it goes at the end of the interval. Why:
ARCHITECTURE.md, "Writing results".
"""

from __future__ import annotations

from collections.abc import Iterable

TRIM_INTERVAL_S = 0.5
"""The longest an acknowledged entry waits for its trim, and the shortest time between two
trims of one stream by one worker."""

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


class TrimSchedule:
    """When each request stream is trimmed next: pure bookkeeping, times passed in (monotonic)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        """When each stream was last trimmed."""
        self._due: dict[str, float] = {}
        """Streams acknowledged since their last trim, and when their next trim may go."""

    def take(self, acked: Iterable[str], now: float, *, all_due: bool = False) -> list[str]:
        """The streams to trim now, given those acknowledged now: each of them that was not
        trimmed in the last interval, and every stream whose trim fell due (``all_due``: every
        stream waiting for one, the final trims on shutdown). The caller trims them, after
        their XACKs, and reports a trim that failed with ``failed``."""
        for stream in acked:
            if stream not in self._due:
                self._due[stream] = self._last.get(stream, now - self._interval_s) + (
                    self._interval_s
                )
        trims = [s for s, due in self._due.items() if all_due or due <= now]
        for stream in trims:
            del self._due[stream]
            self._last[stream] = now
        return trims

    def failed(self, streams: Iterable[str], now: float) -> None:
        """These trims did not happen: try again an interval from now."""
        for stream in streams:
            self._due[stream] = now + self._interval_s

    def next_due(self) -> float | None:
        """When the earliest waiting trim falls due (monotonic); None when none waits."""
        return min(self._due.values(), default=None)

    @property
    def waiting(self) -> bool:
        return bool(self._due)
