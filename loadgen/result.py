"""The outcome of one load run, shared by every load mode (closed loop now, open loop later)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadgen.stats import RequestStats

__all__ = ["PERCENTILES", "LoadResult"]

#: Percentiles reported in :attr:`LoadResult.latency_ms`, by key.
PERCENTILES: dict[str, float] = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}


@dataclass
class LoadResult:
    """What a load run measured (warm-up excluded).

    * ``requests``: requests recorded in the measurement window, whatever their outcome;
    * ``ok``: those answered 2xx; ``errors``: the others, by HTTP status code (``"503"``) or
      exception class name (``"RequestTimeout"``, ``"ConnectError"``...);
    * ``duration_s``: from the start of measurement to the last recorded completion (or to the
      end of the window when nothing completed);
    * ``throughput_rps`` = requests / duration_s, ``ok_rps`` = ok / duration_s;
    * ``latency_ms``: p50/p90/p99/p99.9/max/mean of the **2xx** responses, in milliseconds
      (``None`` when there were none); from the request's write to its last response byte;
    * ``client_cpu_s`` / ``client_cpu_share``: CPU time this process used over the
      measurement window, and that as a share of one core (1.0 = one core fully busy).
    """

    mode: str
    url: str
    concurrency: int
    requests: int
    ok: int
    errors: dict[str, int]
    status_counts: dict[int, int]
    duration_s: float
    throughput_rps: float
    ok_rps: float
    latency_ms: dict[str, float | None]
    warmup_requests: int = 0
    client_cpu_s: float = 0.0
    client_cpu_share: float = 0.0
    target_rps: float | None = None
    stats: RequestStats = field(default_factory=RequestStats, repr=False, compare=False)

    @property
    def error_count(self) -> int:
        return self.requests - self.ok

    @classmethod
    def from_stats(
        cls,
        stats: RequestStats,
        *,
        mode: str,
        url: str,
        concurrency: int,
        duration_s: float,
        warmup_requests: int = 0,
        client_cpu_s: float = 0.0,
        target_rps: float | None = None,
    ) -> LoadResult:
        hist = stats.latency
        latency: dict[str, float | None]
        if hist.count:
            latency = {k: hist.percentile(p) * 1e3 for k, p in PERCENTILES.items()}
            latency["max"] = hist.max * 1e3
            latency["mean"] = hist.mean * 1e3
        else:
            latency = dict.fromkeys([*PERCENTILES, "max", "mean"])
        requests = stats.total
        ok = stats.ok
        safe_duration = duration_s if duration_s > 0 else float("inf")
        return cls(
            mode=mode,
            url=url,
            concurrency=concurrency,
            requests=requests,
            ok=ok,
            errors=stats.errors,
            status_counts=dict(sorted(stats.statuses.items())),
            duration_s=duration_s,
            throughput_rps=requests / safe_duration,
            ok_rps=ok / safe_duration,
            latency_ms=latency,
            warmup_requests=warmup_requests,
            client_cpu_s=client_cpu_s,
            client_cpu_share=client_cpu_s / safe_duration,
            target_rps=target_rps,
            stats=stats,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (the raw histogram is left out; see ``stats.to_dict()``)."""
        return {
            "mode": self.mode,
            "url": self.url,
            "concurrency": self.concurrency,
            "target_rps": self.target_rps,
            "requests": self.requests,
            "ok": self.ok,
            "error_count": self.error_count,
            "errors": dict(self.errors),
            "status_counts": {str(k): v for k, v in self.status_counts.items()},
            "duration_s": self.duration_s,
            "throughput_rps": self.throughput_rps,
            "ok_rps": self.ok_rps,
            "latency_ms": dict(self.latency_ms),
            "warmup_requests": self.warmup_requests,
            "client_cpu_s": self.client_cpu_s,
            "client_cpu_share": self.client_cpu_share,
        }

    def summary(self) -> str:
        """A few human-readable lines."""
        lat = self.latency_ms

        def ms(key: str) -> str:
            v = lat.get(key)
            return "-" if v is None else f"{v:.3f}"

        target = f" target={self.target_rps:g}rps" if self.target_rps else ""
        lines = [
            f"{self.mode} loop  {self.url}  concurrency={self.concurrency}{target}",
            f"  requests {self.requests} in {self.duration_s:.2f}s "
            f"= {self.throughput_rps:.1f} req/s  (ok {self.ok}, {self.ok_rps:.1f} req/s; "
            f"warm-up {self.warmup_requests})",
            f"  latency ms (2xx): p50 {ms('p50')}  p90 {ms('p90')}  p99 {ms('p99')}  "
            f"p99.9 {ms('p99.9')}  max {ms('max')}  mean {ms('mean')}",
            f"  client cpu {self.client_cpu_s:.2f}s = {self.client_cpu_share:.0%} of one core",
        ]
        if self.errors:
            errs = ", ".join(f"{k}: {v}" for k, v in self.errors.items())
            lines.append(f"  errors {self.error_count}: {errs}")
        return "\n".join(lines)
