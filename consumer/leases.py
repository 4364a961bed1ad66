"""The leases of the async jobs this worker runs (``protocol.jobs``: ``CLAIM_SCRIPT``,
``RENEW_SCRIPT``).

The dispatcher claims a batch's jobs here before it runs them and lets them go when the batch
is over; the advertiser's heartbeat renews every lease held meanwhile. A lease is three
heartbeats long, so one or two missed beats (a slow Redis) do not lose it, but at most a third
of ``claim_idle_ms``: a dead worker's entries become reclaimable ``claim_idle_ms`` after their
last renewal, which comes at least every third of it plus a reclaimer pass, so the worker that
reclaims them finds the lease lapsed and runs the job again. A lease that lapses while its
worker lives is harmless: nobody else gets the job's entry while that worker renews it, and the
worker itself claims again under its own name. Should a reclaimer still find a lease live, it
leaves the entry pending for a later reclaim instead of dropping it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from protocol.jobs import Claim
from runtime.broker import Script


def lease_ms(heartbeat_s: float, claim_idle_ms: int) -> int:
    """Three heartbeats, at most a third of ``claim_idle_ms`` (and at least 1 ms)."""
    return max(1, min(int(3 * heartbeat_s * 1000), claim_idle_ms // 3))


class JobLeases:
    """The job records (keys) this worker holds leases on."""

    def __init__(self, worker_id: str, lease_ms: int, claim: Script, renew: Script) -> None:
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self._claim = claim
        self._renew = renew
        self._held: set[str] = set()

    def __len__(self) -> int:
        return len(self._held)

    async def claim(self, keys: Sequence[str], started_ms: int) -> list[str | None]:
        """Claim each job (``CLAIM_SCRIPT``): per key ``Claim.CLAIMED`` or ``Claim.AGAIN``
        (run it: its lease is held here from now on), ``Claim.LEASED``, or the status it is in
        (None where there is no record). Raises what Redis raises: nothing is held then."""
        replies = await self._claim.per_key(keys, [self.worker_id, self.lease_ms, started_ms])
        out = [None if r is None else r.decode() for r in replies]
        self._held.update(k for k, r in zip(keys, out, strict=True) if r in _RUN)
        return out

    def release(self, keys: Iterable[str]) -> None:
        """The batch is over (its outcomes go to the writer): no more renewals."""
        self._held.difference_update(keys)

    async def renew(self) -> int:
        """Renew every lease held (``RENEW_SCRIPT``); the number renewed."""
        if not self._held:
            return 0
        keys = sorted(self._held)
        return sum(int(n) for n in await self._renew.per_key(keys, [self.worker_id, self.lease_ms]))


_RUN = {Claim.CLAIMED.value, Claim.AGAIN.value}
