"""The outcome of one load run, shared by every load mode (closed loop, open loop, jobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loadgen.stats import LatencyHistogram, RequestStats

if TYPE_CHECKING:
    from loadgen.recorder import Recorder, TimelineRow

__all__ = ["PERCENTILES", "LoadResult", "latency_summary"]

#: Percentiles reported in :attr:`LoadResult.latency_ms`, by key.
PERCENTILES: dict[str, float] = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}


def latency_summary(hist: LatencyHistogram) -> dict[str, float | None]:
    """p50/p90/p99/p99.9/max/mean of a histogram in milliseconds (``None`` when empty)."""
    if not hist.count:
        return dict.fromkeys([*PERCENTILES, "max", "mean"])
    latency: dict[str, float | None] = {k: hist.percentile(p) * 1e3 for k, p in PERCENTILES.items()}
    latency["max"] = hist.max * 1e3
    latency["mean"] = hist.mean * 1e3
    return latency


@dataclass
class LoadResult:
    """What a load run measured (warm-up excluded).

    * ``requests``: requests started (open loop: due) in the measurement window, whatever their
      outcome, each awaited to its end; ``ok``: those answered 2xx; ``errors``: the others, by
      HTTP status code (``"503"``) or exception class name (``"RequestTimeout"``...);
    * ``duration_s``: the measurement window (shorter than asked when ``max_requests`` or a
      stop ended it early);
    * ``throughput_rps``, ``ok_rps``: completions (2xx) that fell inside the window, per second
      of it, whenever their request started (the wrk convention: a long final drain does not
      dilute it);
    * ``latency_ms``: p50/p90/p99/p99.9/max/mean of the **2xx** responses, in milliseconds
      (``None`` when there were none); closed loop: from the request's write to its last
      response byte; open loop: from its intended send time (see :mod:`loadgen.open`);
    * ``client_cpu_s`` / ``client_cpu_share``: CPU time this process used over the
      measurement window, and that as a share of one core (1.0 = one core fully busy);
    * ``concurrency``: closed loop, the number of workers; open loop, the most connections
      that were open at once;
    * open loop only: ``target_rps`` (the schedule's mean rate over the window),
      ``offered_rps`` (measured arrivals per second of the window), ``service_ms`` (2xx
      latency from the actual write), ``send_lag_ms`` (how late writes were), ``schedule``;
    * ``timeline``: one :class:`~loadgen.recorder.TimelineRow` per second of measurement, by
      completion time (the last ones may hold requests that finished after the window,
      ``window_s`` long, closed: charts leave those out);
    * ``extra``: mode-specific figures (jobs mode: ``{"jobs": {...}}``).
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
    offered_rps: float | None = None
    schedule: str | None = None
    service_ms: dict[str, float | None] | None = None
    send_lag_ms: dict[str, float | None] | None = None
    timeline: list[TimelineRow] = field(default_factory=list, repr=False)
    window_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
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
        completed: int | None = None,
        completed_ok: int | None = None,
        **more: Any,
    ) -> LoadResult:
        """``completed``/``completed_ok``: completions (2xx) inside the window, for throughput;
        by default the recorded requests (and their 2xx) are used."""
        requests = stats.total
        ok = stats.ok
        safe_duration = duration_s if duration_s > 0 else float("inf")
        done = requests if completed is None else completed
        done_ok = ok if completed_ok is None else completed_ok
        return cls(
            mode=mode,
            url=url,
            concurrency=concurrency,
            requests=requests,
            ok=ok,
            errors=stats.errors,
            status_counts=dict(sorted(stats.statuses.items())),
            duration_s=duration_s,
            throughput_rps=done / safe_duration,
            ok_rps=done_ok / safe_duration,
            latency_ms=latency_summary(stats.latency),
            warmup_requests=warmup_requests,
            client_cpu_s=client_cpu_s,
            client_cpu_share=client_cpu_s / safe_duration,
            target_rps=target_rps,
            stats=stats,
            **more,
        )

    @classmethod
    def from_recorder(cls, rec: Recorder, **kwargs: Any) -> LoadResult:
        """A result from everything a :class:`~loadgen.recorder.Recorder` holds."""
        if kwargs.get("mode") == "open":
            kwargs.setdefault("service_ms", latency_summary(rec.service))
            lag = latency_summary(rec.send_lag)
            kwargs.setdefault("send_lag_ms", {k: lag[k] for k in ("p50", "p99", "max")})
        if rec.measure_start is not None and rec.measure_end is not None:
            kwargs.setdefault("window_s", rec.measure_end - rec.measure_start)
        return cls.from_stats(rec.stats, timeline=rec.timeline.rows(), **kwargs)

    def histogram(self) -> list[tuple[float, float, int]]:
        """Non-empty latency buckets of the 2xx responses: (low_ms, high_ms, count)."""
        return [(lo * 1e3, hi * 1e3, c) for lo, hi, c in self.stats.latency.buckets()]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: the summary, the per-second timeline and the latency histogram
        (``histogram``: the exact count, sum, min and max plus ``hdr``, the HdrHistogram in its
        standard compressed encoding; ``LatencyHistogram.from_dict`` restores it for merging)."""
        return {
            "mode": self.mode,
            "url": self.url,
            "concurrency": self.concurrency,
            "target_rps": self.target_rps,
            "offered_rps": self.offered_rps,
            "schedule": self.schedule,
            "requests": self.requests,
            "ok": self.ok,
            "error_count": self.error_count,
            "errors": dict(self.errors),
            "status_counts": {str(k): v for k, v in self.status_counts.items()},
            "duration_s": self.duration_s,
            "throughput_rps": self.throughput_rps,
            "ok_rps": self.ok_rps,
            "latency_ms": dict(self.latency_ms),
            "service_ms": None if self.service_ms is None else dict(self.service_ms),
            "send_lag_ms": None if self.send_lag_ms is None else dict(self.send_lag_ms),
            "warmup_requests": self.warmup_requests,
            "client_cpu_s": self.client_cpu_s,
            "client_cpu_share": self.client_cpu_share,
            **self.extra,
            "window_s": self.window_s,
            "timeline": [row.to_dict() for row in self.timeline],
            "histogram": self.stats.latency.to_dict(),
        }

    def summary(self) -> str:
        """A few human-readable lines: rates, counts by status, latency percentiles."""
        lat = self.latency_ms

        def ms(values: dict[str, float | None], key: str) -> str:
            v = values.get(key)
            return "-" if v is None else f"{v:.3f}"

        def pcts(values: dict[str, float | None]) -> str:
            return "  ".join(f"{k} {ms(values, k)}" for k in (*PERCENTILES, "max"))

        if self.mode == "open":
            target = f"{self.target_rps:,.1f}" if self.target_rps is not None else "-"
            head = f"open loop  {self.url}  target {target} req/s"
            if self.schedule:
                head += f" ({self.schedule})"
            head += f"  connections {self.concurrency}"
        else:
            head = f"{self.mode} loop  {self.url}  concurrency={self.concurrency}"
        lines = [
            head,
            f"  throughput {self.throughput_rps:,.1f} req/s  ({self.ok_rps:,.1f} 2xx/s) over "
            f"{self.duration_s:.2f}s;  requests {self.requests:,} (ok {self.ok:,}), "
            f"warm-up {self.warmup_requests:,}",
            f"  status   {format_counts(self.status_counts, self.stats.exceptions)}",
            f"  latency ms (2xx): {pcts(lat)}",
        ]
        if self.mode == "open":
            lines[-1] += "   [from intended send time]"
            if self.service_ms is not None:
                lines.append(f"  service ms (2xx): {pcts(self.service_ms)}   [from actual send]")
            if self.send_lag_ms is not None and self.send_lag_ms.get("p99") is not None:
                lag = self.send_lag_ms
                lines.append(
                    f"  send lag ms: p50 {ms(lag, 'p50')}  p99 {ms(lag, 'p99')}  "
                    f"max {ms(lag, 'max')}"
                    + (f"  (offered {self.offered_rps:,.1f} req/s)" if self.offered_rps else "")
                )
        jobs = self.extra.get("jobs")
        if jobs:
            finals = ", ".join(f"{k} {v:,}" for k, v in sorted(jobs["final_status"].items()))
            lines.append(
                f"  jobs: submitted {jobs['submitted']:,}, polls {jobs['polls']:,} "
                f"({jobs['polls_per_job']:.2f}/job), final: {finals or '-'}"
            )
        lines.append(
            f"  client cpu {self.client_cpu_s:.2f}s = {self.client_cpu_share:.0%} of one core"
        )
        return "\n".join(lines)


def format_counts(statuses: dict[int, int], exceptions: dict[str, int]) -> str:
    """``200 x1,234  503 x12  RequestTimeout x1`` (``-`` when nothing was recorded)."""
    parts = [f"{s} x{n:,}" for s, n in sorted(statuses.items())]
    parts += [f"{k} x{n:,}" for k, n in sorted(exceptions.items())]
    return "  ".join(parts) if parts else "-"
