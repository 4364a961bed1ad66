"""The autoscaler glue of ``inferq up``: each new backlog reading goes to the policy once, each
change is logged with its reason, counted, and applied to the worker slots; the probe's
reading goes stale when Redis stops answering."""

from __future__ import annotations

from inferq.autoscale import Reading, ScalingPolicy, ScalingTargets, WorkerRange
from inferq.scaler import Autoscaler, BacklogProbe, Sample, UpMetrics
from protocol.keys import Keys
from runtime.connections import RedisSettings
from tests.support import wait_until


class FakeProbe:
    def __init__(self) -> None:
        self.sample: Sample | None = None

    def latest(self) -> Sample | None:
        return self.sample


class FakeSupervisor:
    def __init__(self) -> None:
        self.scaled: list[tuple[str, int, float]] = []
        self.count = 1

    def scale(self, role: str, count: int, *, stop_timeout_s: float) -> None:
        self.scaled.append((role, count, stop_timeout_s))
        self.count = count

    def running(self, role: str) -> int:
        return self.count


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))


def autoscaler(now: list[float]):
    probe, supervisor, logger, metrics = FakeProbe(), FakeSupervisor(), Lines(), UpMetrics()
    policy = ScalingPolicy(
        WorkerRange(0, 4), ScalingTargets(backlog_per_worker=10, scale_down_after_s=5), now=0.0
    )
    a = Autoscaler(
        policy,
        supervisor,  # type: ignore[arg-type]
        probe,
        metrics,
        stop_timeout_s=35,
        clock=lambda: now[0],
        logger=logger,
    )
    return a, probe, supervisor, logger, metrics


def sample_value(metrics: UpMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels or None)


def test_a_new_reading_scales_the_workers_once_and_says_why():
    now = [1.0]
    a, probe, supervisor, logger, metrics = autoscaler(now)
    probe.sample = Sample(1, 1.0, Reading(35, oldest_wait_s=0.5))
    a.tick()
    a.tick()  # the same reading again: nothing more
    assert supervisor.scaled == [("worker", 4, 35)]
    assert logger.lines == [
        (
            "scaling up",
            {
                "workers_before": 1,
                "workers_wanted": 4,
                "reason": "backlog",
                "backlog": 35,
                "oldest_wait_s": 0.5,
            },
        )
    ]
    assert sample_value(metrics, "inferq_up_workers_wanted") == 4
    assert sample_value(metrics, "inferq_up_workers_running") == 4
    events = "inferq_up_scaling_events_total"
    assert sample_value(metrics, events, reason="backlog", direction="up") == 1
    assert sample_value(metrics, events, reason="idle", direction="down") == 0


def test_idleness_over_the_window_scales_to_zero():
    now = [0.0]
    a, probe, supervisor, logger, metrics = autoscaler(now)
    for seq, t in enumerate([1.0, 3.0, 6.5], start=1):
        now[0] = t
        probe.sample = Sample(seq, t, Reading(0))
        a.tick()
    assert supervisor.scaled == [("worker", 0, 35)]
    assert logger.lines[-1][1]["reason"] == "idle"
    assert sample_value(metrics, "inferq_up_workers_wanted") == 0


def test_the_probe_reads_the_backlog_of_redis_and_its_reading_goes_stale(redis_url, namespace):
    now = [100.0]
    probe = BacklogProbe(RedisSettings(redis_url), Keys(namespace), 0.05, clock=lambda: now[0])
    assert probe.latest() is None
    probe.start()
    try:
        wait_until(lambda: probe.latest() is not None, what="a first reading")
    finally:
        probe.stop()
    sample = probe.latest()
    assert sample is not None and sample.reading == Reading(0, live=0) and sample.at == 100.0
    now[0] += 0.05 * 3 + 0.01  # three intervals without a reading (Redis gone, say)
    assert probe.latest() is None
