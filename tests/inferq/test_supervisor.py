"""The supervisor replaces a child that exits at once, backs off while it keeps crashing, says
when that is a crash loop, gives up on a configuration error, and stops children role by role.

No processes and no sleeps: the clock and the process launcher are injected."""

from __future__ import annotations

import signal

import pytest

from inferq.supervisor import (
    Backoff,
    ChildSpec,
    EventLog,
    Exited,
    GaveUp,
    RestartPolicy,
    Started,
    Stopped,
    Supervisor,
)
from protocol.exits import RESTARTS_ENV, restarts_from


class FakeProcess:
    """A child that runs until the test ends it; SIGTERM ends it with code 0."""

    next_pid = 100

    def __init__(self, spec: ChildSpec, log: list[tuple[str, object]]) -> None:
        FakeProcess.next_pid += 1
        self.pid = FakeProcess.next_pid
        self.spec = spec
        self.code: int | None = None
        self.log = log
        self.ignores_sigterm = False

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.log.append((self.spec.name, sig))
        if sig == signal.SIGTERM and not self.ignores_sigterm:
            self.code = 0

    def kill(self) -> None:
        self.log.append((self.spec.name, signal.SIGKILL))
        self.code = -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            import subprocess

            raise subprocess.TimeoutExpired("fake", timeout or 0)
        return self.code


class RecordingLogger:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, object]]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


class Harness:
    def __init__(
        self,
        *names: str,
        policy: RestartPolicy | None = None,
        start: dict[str, int] | None = None,
    ) -> None:
        self.now = 0.0
        self.events: list[object] = []
        self.logger = RecordingLogger()
        self.log = EventLog(self.logger)
        self.signals: list[tuple[str, object]] = []
        self.spawned: list[FakeProcess] = []
        specs = [ChildSpec(n, n.split()[0], ("x",)) for n in names]
        self.sup = Supervisor(
            specs,
            spawn=self._spawn,
            clock=lambda: self.now,
            policy=policy,
            on_event=self._event,
        )
        self.sup.start(start)

    def _event(self, event: object) -> None:
        self.events.append(event)
        self.log(event)  # type: ignore[arg-type]

    def _spawn(self, spec: ChildSpec) -> FakeProcess:
        p = FakeProcess(spec, self.signals)
        self.spawned.append(p)
        return p

    def current(self, name: str) -> FakeProcess:
        return [p for p in self.spawned if p.spec.name == name][-1]

    def crash(self, name: str, code: int = -signal.SIGKILL, after_s: float = 1.0) -> None:
        """The slot's current process exits ``after_s`` after the clock's present time."""
        self.now += after_s
        self.current(name).code = code
        self.sup.tick()

    def exits(self) -> list[Exited]:
        return [e for e in self.events if isinstance(e, Exited)]


# -- the backoff policy ------------------------------------------------------------------------


def test_the_first_crash_is_restarted_at_once_then_the_delay_doubles_up_to_the_cap():
    backoff = Backoff(RestartPolicy(base_delay_s=0.5, max_delay_s=4, stable_after_s=10))
    delays = [backoff.exited(ran_s=1).delay_s for _ in range(7)]
    assert delays == [0, 0.5, 1, 2, 4, 4, 4]


def test_a_child_that_ran_long_enough_is_restarted_at_once_again():
    backoff = Backoff(RestartPolicy(stable_after_s=10))
    for _ in range(4):
        backoff.exited(ran_s=1)
    decision = backoff.exited(ran_s=60)
    assert decision.delay_s == 0 and decision.exits_in_a_row == 1 and not decision.crash_loop


def test_quick_exits_in_a_row_are_a_crash_loop():
    backoff = Backoff(RestartPolicy(crash_loop_after=3))
    loops = [backoff.exited(ran_s=0.2).crash_loop for _ in range(4)]
    assert loops == [False, False, True, True]


# -- the supervisor ----------------------------------------------------------------------------


def test_a_killed_child_is_replaced_at_once_and_the_restart_counted():
    h = Harness("worker 0", "gateway 0")
    first = h.current("worker 0")
    h.crash("worker 0")
    replacement = h.current("worker 0")
    assert replacement is not first and replacement.code is None
    assert h.sup.restarts == {"worker 0": 1, "gateway 0": 0}
    assert h.events[-1] == Started("worker 0", replacement.pid, 1)
    assert h.exits()[0].code == -signal.SIGKILL and h.exits()[0].decision.delay_s == 0
    assert h.logger.lines[-2:] == [
        (
            "warning",
            "child exited",
            {
                "child": "worker 0",
                "pid": first.pid,
                "exit": "killed by SIGKILL",
                "ran_s": 1.0,
                "restart_in_s": 0.0,
                "restarts": 0,
            },
        ),
        (
            "warning",
            "child restarted",
            {"child": "worker 0", "pid": replacement.pid, "restarts": 1, "restarts_total": 1},
        ),
    ]


def test_a_clean_exit_nobody_asked_for_is_replaced_too():
    h = Harness("worker 0")
    h.crash("worker 0", code=0)
    assert h.sup.restarts["worker 0"] == 1 and h.current("worker 0").code is None


def test_a_child_that_keeps_crashing_waits_out_its_backoff_before_each_restart():
    h = Harness("worker 0", policy=RestartPolicy(base_delay_s=0.5, crash_loop_after=3))
    h.crash("worker 0", code=70, after_s=0.1)  # restarted at once
    h.crash("worker 0", code=70, after_s=0.1)  # again: 0.5 s backoff
    assert h.sup.restarts["worker 0"] == 1 and h.current("worker 0").code == 70
    assert h.sup.next_tick_s(poll_s=5) == pytest.approx(0.5)
    h.now += 0.4
    h.sup.tick()
    assert h.sup.restarts["worker 0"] == 1  # not yet due
    h.now += 0.1
    h.sup.tick()
    assert h.sup.restarts["worker 0"] == 2 and h.current("worker 0").code is None
    h.crash("worker 0", code=70, after_s=0.1)
    third = h.exits()[-1]
    assert third.decision.crash_loop and third.decision.delay_s == 1.0
    level, event, fields = h.logger.lines[-1]
    assert (level, event, fields["exits_in_a_row"], fields["exit"]) == (
        "error",
        "crash loop",
        3,
        "exit code 70",
    )
    assert h.log.restarts == 2


def test_a_configuration_error_is_not_restarted_and_fails_the_supervisor():
    h = Harness("worker 0", "gateway 0")
    h.crash("worker 0", code=2)
    assert h.sup.restarts["worker 0"] == 0 and len(h.spawned) == 2
    assert isinstance(h.events[-1], GaveUp)
    assert h.sup.failure is not None and "worker 0 exit code 2" in h.sup.failure


def test_stop_drains_workers_before_gateways_and_restarts_nothing():
    h = Harness("worker 0", "worker 1", "gateway 0")
    h.current("worker 0").code = -signal.SIGKILL  # exits just as the stop begins
    h.sup.stop([("worker", 5), ("gateway", 5)])
    h.sup.tick()
    assert [name for name, _ in h.signals] == ["worker 1", "gateway 0"]
    assert all(sig == signal.SIGTERM for _, sig in h.signals)
    assert len(h.spawned) == 3 and h.sup.processes() == []


def test_a_child_that_ignores_sigterm_is_killed_at_its_roles_timeout():
    h = Harness("gateway 0")
    h.current("gateway 0").ignores_sigterm = True
    h.sup.stop([("gateway", 0.05)])
    assert h.signals == [("gateway 0", signal.SIGTERM), ("gateway 0", signal.SIGKILL)]


# -- scaling a role (inferq up --workers MIN:MAX) ---------------------------------------------


def test_a_role_can_start_with_only_its_first_slots():
    h = Harness("worker 0", "worker 1", "worker 2", "gateway 0", start={"worker": 1})
    assert [p.spec.name for p in h.spawned] == ["worker 0", "gateway 0"]
    assert h.sup.running("worker") == 1


def test_scaling_up_starts_the_next_slots_as_scaled_not_as_restarts():
    h = Harness("worker 0", "worker 1", "worker 2", start={"worker": 1})
    h.sup.scale("worker", 3, stop_timeout_s=10)
    assert [p.spec.name for p in h.spawned] == ["worker 0", "worker 1", "worker 2"]
    assert h.sup.running("worker") == 3
    assert h.events[-1] == Started("worker 2", h.current("worker 2").pid, 0, scaled=True)
    assert h.sup.restarts == {"worker 0": 0, "worker 1": 0, "worker 2": 0}
    assert h.log.restarts == 0


def test_scaling_down_sigterms_the_last_slots_and_does_not_replace_them():
    h = Harness("worker 0", "worker 1", "worker 2")
    h.sup.scale("worker", 1, stop_timeout_s=10)
    assert h.signals == [("worker 1", signal.SIGTERM), ("worker 2", signal.SIGTERM)]
    h.now += 1
    h.sup.tick()
    stopped = [e for e in h.events if isinstance(e, Stopped)]
    assert [(e.name, e.killed) for e in stopped] == [("worker 1", False), ("worker 2", False)]
    assert len(h.spawned) == 3 and h.sup.running("worker") == 1
    assert h.exits() == [] and h.sup.restarts["worker 1"] == 0


def test_a_draining_worker_is_not_counted_running_and_is_killed_after_its_timeout():
    h = Harness("worker 0", "worker 1")
    h.current("worker 1").ignores_sigterm = True
    h.sup.scale("worker", 1, stop_timeout_s=10)
    assert h.sup.running("worker") == 1
    h.now = 9.0
    h.sup.tick()
    assert h.current("worker 1").code is None  # still draining
    h.now = 10.0
    h.sup.tick()
    assert ("worker 1", signal.SIGKILL) in h.signals
    assert [e.killed for e in h.events if isinstance(e, Stopped)] == [True]


def test_a_slot_wanted_again_while_it_drains_starts_only_once_its_process_has_exited():
    h = Harness("worker 0", "worker 1")
    draining = h.current("worker 1")
    draining.ignores_sigterm = True
    h.sup.scale("worker", 1, stop_timeout_s=10)
    h.sup.scale("worker", 2, stop_timeout_s=10)
    assert h.current("worker 1") is draining  # one consumer name, never two processes
    draining.code = 0
    h.now += 1
    h.sup.tick()
    assert h.current("worker 1") is not draining and h.current("worker 1").code is None
    assert h.sup.running("worker") == 2


def test_a_crash_of_a_wanted_slot_is_still_restarted_and_counted():
    h = Harness("worker 0", "worker 1", start={"worker": 1})
    h.sup.scale("worker", 2, stop_timeout_s=10)
    h.crash("worker 1")
    assert h.sup.restarts["worker 1"] == 1 and h.sup.running("worker") == 2


def test_stop_does_not_send_a_second_sigterm_to_a_draining_worker():
    h = Harness("worker 0", "worker 1")
    h.current("worker 1").ignores_sigterm = True
    h.sup.scale("worker", 1, stop_timeout_s=10)
    h.sup.stop([("worker", 0.01)])  # (a second SIGTERM would end its drain at once)
    assert h.signals.count(("worker 1", signal.SIGTERM)) == 1
    assert h.signals.count(("worker 0", signal.SIGTERM)) == 1


def test_each_process_is_told_how_often_its_slot_was_restarted_before_it():
    h = Harness("worker 0", "worker 1")
    h.crash("worker 0")
    h.crash("worker 0", after_s=60)  # ran long enough: restarted at once again
    told = [(p.spec.name, p.spec.env[RESTARTS_ENV]) for p in h.spawned]
    assert told == [("worker 0", "0"), ("worker 1", "0"), ("worker 0", "1"), ("worker 0", "2")]


def test_the_restart_count_reaches_the_workers_settings_through_its_variable():
    assert restarts_from({RESTARTS_ENV: "4"}) == 4
    assert restarts_from({}) == 0  # no supervisor
    assert [restarts_from({RESTARTS_ENV: v}) for v in ("", "-1", "x", "²")] == [0, 0, 0, 0]
