"""Keeps a set of child processes running: what ``inferq up`` and ``inferq gateway --gateways N``
do with their gateways and workers, as gunicorn's arbiter and ``uvicorn --workers`` do.

A child that exits without being asked to is replaced at once; one that keeps exiting soon after
it starts is restarted with exponential backoff and reported as a crash loop. A child that exits
with ``EXIT_USAGE`` (2: a bad flag, a broken model repository, a port in use) would fail the same
way again, so the supervisor gives up on it and says why. Only ``stop`` ends the children, role
by role, in the order given (workers drain first, then gateways).

The slots of a role can also be scaled (``scale``: what ``inferq up --workers MIN:MAX`` does):
a slot no longer wanted gets SIGTERM, drains in its own time while everything else carries on
(SIGKILL after its stop timeout), and is not restarted when it exits; a slot wanted again
starts at once, or as soon as its draining process has exited (a slot keeps one consumer name,
which two processes must never share).

Every child gets its slot's restart count so far in ``INFERQ_RESTARTS``
(``protocol.exits.RESTARTS_ENV``), which a worker advertises for the console.

The policy (``Backoff``) is pure and takes the time as an argument; the ``Supervisor`` gets its
clock and its process launcher injected. Both are tested without processes or sleeps.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from protocol.exits import EXIT_USAGE, RESTARTS_ENV


@dataclass(frozen=True)
class RestartPolicy:
    base_delay_s: float = 0.5
    """The delay before the second restart in a row; it doubles with each further one."""
    max_delay_s: float = 30.0
    stable_after_s: float = 10.0
    """A child that ran at least this long before it exited is restarted at once again."""
    crash_loop_after: int = 3
    """This many exits in a row, each within ``stable_after_s`` of its start: a crash loop."""


@dataclass(frozen=True)
class Decision:
    delay_s: float
    """How long to wait before the restart (0: at once)."""
    exits_in_a_row: int
    """Exits within ``window_s`` of their start, this one included."""
    crash_loop: bool
    window_s: float
    """The policy's ``stable_after_s``."""


class Backoff:
    """When to restart one child: at once after a first crash, then after 0.5, 1, 2, ... s (up to
    ``max_delay_s``) while it keeps crashing soon after it starts."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._in_a_row = 0

    def exited(self, ran_s: float) -> Decision:
        p = self.policy
        self._in_a_row = 1 if ran_s >= p.stable_after_s else self._in_a_row + 1
        n = self._in_a_row
        delay = 0.0 if n == 1 else min(p.max_delay_s, p.base_delay_s * 2 ** (n - 2))
        return Decision(delay, n, n >= p.crash_loop_after, p.stable_after_s)


class Process(Protocol):
    """What the supervisor needs of a child (``subprocess.Popen`` has it)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True)
class ChildSpec:
    """One supervised slot: every process started for it gets the same arguments."""

    name: str
    """For people: ``worker 0``, ``gateway 1``."""
    role: str
    """Children stop role by role (``Supervisor.stop``)."""
    argv: tuple[str, ...]
    """Arguments of ``python -m inferq``."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set on top of this process's environment."""
    pass_fds: tuple[int, ...] = ()
    """File descriptors the child inherits (a gateway's listening socket)."""


# -- events: what the supervisor reports, for the log and for ``inferq up``'s output -----------


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True)
class Started:
    name: str
    pid: int
    restarts: int
    """Restarts of this slot so far (0: its first process)."""
    scaled: bool = False
    """Started because the slot became wanted (``Supervisor.scale``), not as a restart."""


@dataclass(frozen=True)
class Stopped:
    """A slot no longer wanted: its process was asked to stop, and exited (or was killed)."""

    name: str
    pid: int
    code: int
    ran_s: float
    killed: bool
    """It outlived its stop timeout and was sent SIGKILL."""


@dataclass(frozen=True)
class Exited:
    name: str
    pid: int
    code: int
    ran_s: float
    decision: Decision
    restarts: int
    """Restarts of this slot before this exit."""


@dataclass(frozen=True)
class GaveUp:
    name: str
    pid: int
    code: int
    reason: str


Event = Started | Exited | GaveUp | Stopped


class EventLog:
    """Writes events to the structured log, counting restarts: one line per start, exit and
    restart (with this slot's and all slots' restart counts), an error line for a crash loop."""

    def __init__(self, logger: Any) -> None:
        self._log = logger
        self.restarts = 0

    def __call__(self, event: Event) -> None:
        if isinstance(event, Stopped):
            log = self._log.warning if event.killed else self._log.info
            log(
                "child stopped",
                child=event.name,
                pid=event.pid,
                exit=describe_exit(event.code),
                ran_s=round(event.ran_s, 3),
                killed=event.killed,
            )
        elif isinstance(event, Started):
            if event.restarts and not event.scaled:
                self.restarts += 1
                self._log.warning(
                    "child restarted",
                    child=event.name,
                    pid=event.pid,
                    restarts=event.restarts,
                    restarts_total=self.restarts,
                )
            else:
                self._log.info(
                    "child started", child=event.name, pid=event.pid, scaled=event.scaled
                )
        elif isinstance(event, GaveUp):
            self._log.error(
                "child not restarted",
                child=event.name,
                pid=event.pid,
                code=event.code,
                reason=event.reason,
            )
        else:
            d = event.decision
            fields = {
                "child": event.name,
                "pid": event.pid,
                "exit": describe_exit(event.code),
                "ran_s": round(event.ran_s, 3),
                "restart_in_s": d.delay_s,
                "restarts": event.restarts,
            }
            if d.crash_loop:
                self._log.error(
                    "crash loop",
                    exits_in_a_row=d.exits_in_a_row,
                    hint=f"each exit came within {d.window_s:g} s of its start; the child's own "
                    "messages above say why; restarts continue with backoff",
                    **fields,
                )
            else:
                self._log.warning("child exited", **fields)


# -- the supervisor ----------------------------------------------------------------------------


@dataclass
class _Slot:
    spec: ChildSpec
    backoff: Backoff
    process: Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None
    given_up: bool = False
    wanted: bool = True
    """Cleared by ``scale``: the slot's process is asked to stop and not replaced."""
    stop_by: float | None = None
    """While its process drains after SIGTERM (no longer wanted): when it is killed."""


Spawn = Callable[[ChildSpec], Process]


class Supervisor:
    """Starts one process per ``ChildSpec`` and keeps each slot filled until ``stop``."""

    def __init__(
        self,
        specs: Iterable[ChildSpec],
        *,
        spawn: Spawn,
        clock: Callable[[], float] = time.monotonic,
        policy: RestartPolicy | None = None,
        on_event: Callable[[Event], None] = lambda event: None,
    ) -> None:
        self._policy = policy or RestartPolicy()
        self._slots = [_Slot(spec, Backoff(self._policy)) for spec in specs]
        self._spawn = spawn
        self._clock = clock
        self._on_event = on_event
        self._stopping = False
        self.failure: str | None = None
        """Set when a child exited in a way no restart can fix; the caller should stop."""

    def start(self, counts: Mapping[str, int] | None = None) -> None:
        """Start every slot, or, for a role in ``counts``, only that many of its first slots
        (the others wait for ``scale``)."""
        counts = counts or {}
        for role in counts:
            for i, slot in enumerate(self._role(role)):
                slot.wanted = i < counts[role]
        for slot in self._slots:
            if slot.wanted:
                self._launch(slot)

    def scale(self, role: str, count: int, *, stop_timeout_s: float) -> None:
        """Want the first ``count`` slots of ``role`` running, and no more: start the missing
        ones, SIGTERM the extra ones (the last slots first), which may take up to
        ``stop_timeout_s`` to drain before they are killed."""
        if self._stopping:
            return
        now = self._clock()
        for i, slot in enumerate(self._role(role)):
            wanted = i < count
            if wanted == slot.wanted:
                continue
            slot.wanted = wanted
            if wanted:
                if slot.process is None and self.failure is None:
                    slot.restart_at = None
                    self._launch(slot, scaled=True)
                continue  # a process still draining is replaced when it exits (``tick``)
            slot.restart_at = None
            if slot.process is not None and slot.stop_by is None:
                slot.process.send_signal(signal.SIGTERM)
                slot.stop_by = now + stop_timeout_s

    def running(self, role: str) -> int:
        """Processes of ``role`` that run and are wanted (draining ones not counted)."""
        return sum(
            1 for s in self._role(role) if s.process is not None and s.wanted and s.stop_by is None
        )

    def _role(self, role: str) -> list[_Slot]:
        return [s for s in self._slots if s.spec.role == role]

    def tick(self) -> None:
        """Reap children that exited, and start the replacements that are due."""
        if self._stopping:
            return
        now = self._clock()
        for slot in self._slots:
            if slot.process is not None:
                code = slot.process.poll()
                if code is not None and slot.stop_by is not None:
                    self._stopped(slot, code, now, killed=False)
                elif code is not None:
                    self._exited(slot, code, now)
                elif slot.stop_by is not None and now >= slot.stop_by:
                    slot.process.kill()
                    self._stopped(slot, slot.process.wait(), now, killed=True)
            if slot.restart_at is not None and now >= slot.restart_at and self.failure is None:
                slot.restart_at = None
                slot.restarts += 1
                self._launch(slot)

    def next_tick_s(self, poll_s: float) -> float:
        """How long the caller may wait before the next ``tick``: ``poll_s``, or less when a
        restart falls due sooner."""
        now = self._clock()
        due = [s.restart_at - now for s in self._slots if s.restart_at is not None]
        return max(0.0, min([poll_s, *due]))

    def _exited(self, slot: _Slot, code: int, now: float) -> None:
        assert slot.process is not None
        pid, ran_s = slot.process.pid, now - slot.started_at
        slot.process = None
        if code == EXIT_USAGE:
            slot.given_up = True
            reason = "a configuration error, which a restart would only repeat; not restarting"
            self.failure = f"{slot.spec.name} {describe_exit(code)}: {reason}"
            self._on_event(GaveUp(slot.spec.name, pid, code, reason))
            return
        decision = slot.backoff.exited(ran_s)
        slot.restart_at = now + decision.delay_s
        self._on_event(Exited(slot.spec.name, pid, code, ran_s, decision, slot.restarts))

    def _stopped(self, slot: _Slot, code: int, now: float, *, killed: bool) -> None:
        assert slot.process is not None
        pid, ran_s = slot.process.pid, now - slot.started_at
        slot.process, slot.stop_by = None, None
        self._on_event(Stopped(slot.spec.name, pid, code, ran_s, killed))
        if slot.wanted and self.failure is None:
            self._launch(slot, scaled=True)

    def _launch(self, slot: _Slot, *, scaled: bool = False) -> None:
        # The child learns how often its slot was restarted before it (workers advertise it).
        env = {**slot.spec.env, RESTARTS_ENV: str(slot.restarts)}
        slot.process = self._spawn(replace(slot.spec, env=env))
        slot.started_at = self._clock()
        self._on_event(Started(slot.spec.name, slot.process.pid, slot.restarts, scaled))

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts per slot, by name."""
        return {s.spec.name: s.restarts for s in self._slots}

    def processes(self, role: str | None = None) -> list[Process]:
        """The running processes (of one role)."""
        return [
            s.process
            for s in self._slots
            if s.process is not None
            and s.process.poll() is None
            and (role is None or s.spec.role == role)
        ]

    def stop(
        self, order: Iterable[tuple[str, float]], *, force: threading.Event | None = None
    ) -> None:
        """SIGTERM each role's children in turn and wait up to that role's timeout (then
        SIGKILL), e.g. ``[("worker", 35), ("gateway", 15)]``. Nothing is restarted from here on;
        ``force`` set (a second Ctrl-C) kills whatever is still running at once."""
        self._stopping = True
        for slot in self._slots:
            slot.restart_at = None
        # A process draining after ``scale`` has had its SIGTERM: a second one would force it.
        draining = [s.process for s in self._slots if s.process is not None and s.stop_by]
        for role, timeout_s in order:
            terminate(self.processes(role), timeout_s, force=force, signalled=draining)
        terminate(self.processes(), 0)  # any role not named

    def kill_all(self) -> None:
        self._stopping = True
        for p in self.processes():
            if p.poll() is None:
                p.kill()
            p.wait()


def terminate(
    processes: list[Process],
    timeout_s: float,
    *,
    force: threading.Event | None = None,
    signalled: Iterable[Process] = (),
) -> None:
    """SIGTERM (but not to those already ``signalled``), then wait up to ``timeout_s`` for all
    of them together; SIGKILL what is left."""
    skip = {id(p) for p in signalled}
    for p in processes:
        if p.poll() is None and id(p) not in skip:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in processes:
        while p.poll() is None and time.monotonic() < deadline:
            if force is not None and force.is_set():
                break
            try:
                p.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        if p.poll() is None:
            p.kill()
            p.wait()


def supervise(
    supervisor: Supervisor,
    stop: threading.Event,
    poll_s: float = 0.05,
    on_tick: Callable[[], None] | None = None,
) -> None:
    """Tick until ``stop`` is set or a child failed in a way no restart fixes; ``on_tick``
    (the autoscaler's) runs after each tick, on this thread."""
    while not stop.is_set() and supervisor.failure is None:
        supervisor.tick()
        if on_tick is not None:
            on_tick()
        stop.wait(supervisor.next_tick_s(poll_s))


# -- process glue ------------------------------------------------------------------------------


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn_inferq(spec: ChildSpec) -> subprocess.Popen[bytes]:
    """``python -m inferq <argv>``: it dies with this process (Linux), and sits in its own
    process group, so a terminal's Ctrl-C reaches only the supervisor, which stops the children
    in order instead of all at once."""
    # Each worker must have its own consumer name: never hand them a shared INFERQ_WORKER_ID.
    env = {k: v for k, v in os.environ.items() if k != "INFERQ_WORKER_ID"}
    env.update(spec.env)
    return subprocess.Popen(
        [sys.executable, "-m", "inferq", *spec.argv],
        preexec_fn=_die_with_parent,
        process_group=0,
        env=env,
        pass_fds=spec.pass_fds,
    )
