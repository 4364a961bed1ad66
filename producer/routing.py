"""Which version a request that names none goes to: the traffic split, applied per request.

Smooth weighted round-robin (the scheme nginx uses): every pick adds each version's weight to its
credit, takes the version with the most credit and charges it the total. Over any run of
requests the split is as close to the weights as whole requests allow (90/10 gives exactly 9 of
every 10 to the first), deterministically, with no random draw to drift by chance in a short
canary. Each gateway splits its own traffic; the sum over gateways has the same proportions.
"""

from __future__ import annotations


class VersionRouter:
    def __init__(self) -> None:
        self._credit: dict[str, dict[str, float]] = {}
        self._weights: dict[str, dict[str, float]] = {}

    def choose(self, model: str, traffic: dict[str, float]) -> str:
        """One version from ``traffic`` (version -> positive weight; not empty)."""
        if len(traffic) == 1:
            return next(iter(traffic))
        if self._weights.get(model) != traffic:
            self._weights[model] = dict(traffic)
            self._credit[model] = dict.fromkeys(traffic, 0.0)
        credit = self._credit[model]
        for version, weight in traffic.items():
            credit[version] += weight
        chosen = max(credit, key=lambda v: credit[v])
        credit[chosen] -= sum(traffic.values())
        return chosen
