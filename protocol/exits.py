"""How an inferq process ends: the exit statuses every command uses, and the stop signals.

Exit statuses are a contract with whatever runs the process (``inferq up``'s supervisor,
systemd, Kubernetes, a script): a supervisor restarts a child that exits ``EXIT_LOOP_FAILED`` and
gives up on one that exits ``EXIT_USAGE``, which a restart would only repeat. They are named once
here, at the bottom of the layers, so that every command names them from one table, loadgen
(which imports nothing else of the product) included.

``StopSignals`` is the one rule of every long-running command: the first SIGINT or SIGTERM asks
for a graceful stop, a second one forces. Its handlers only set flags and call back.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
"""The command could not do what was asked (a target unreachable, no request succeeded)."""
EXIT_NOT_FOUND = EXIT_FAILED
"""What the command was asked about does not exist (a dead letter, a model)."""
EXIT_USAGE = 2
"""A configuration error that no restart can fix: a bad flag (argparse's status too), a broken
model repository, a port in use."""
EXIT_BACKLOG = 3
"""``inferq lag --fail-above N``: some model's backlog is above N."""
EXIT_REDIS = 4
"""Redis unreachable, or it refused a command (the operator commands)."""
EXIT_LOOP_FAILED = 70
"""A background loop crashed (EX_SOFTWARE): exit so that the supervisor restarts the process."""
EXIT_INTERRUPTED = 130
"""Interrupted before the command could finish (128 + SIGINT, as shells report it)."""

RESTARTS_ENV = "INFERQ_RESTARTS"
"""Set by the supervisor (``inferq up``, ``inferq gateway --gateways N``) on every child it
starts: how many times it restarted that child's slot before (0 for the slot's first process).
A worker advertises it (the console's Workers view). Not a user setting: no flag declares it."""


def restarts_from(environ: Mapping[str, str]) -> int:
    """The restart count a supervisor passed in ``RESTARTS_ENV``; 0 without a supervisor, and
    for a value that is not a count (it is only shown, never acted on)."""
    raw = environ.get(RESTARTS_ENV, "")
    return int(raw) if raw.isascii() and raw.isdigit() else 0


class StopSignals:
    """The first of ``signals`` sets ``stop`` and calls ``on_stop``; a second sets ``force``
    and calls ``on_force``. Install with ``installed()`` (``signal.signal``: no event loop
    needed, previous handlers restored) or ``installed_on(loop)`` (asyncio's handlers)."""

    def __init__(
        self,
        *,
        on_stop: Callable[[], None] | None = None,
        on_force: Callable[[], None] | None = None,
        signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
    ) -> None:
        self.stop = threading.Event()
        self.force = threading.Event()
        self._on_stop = on_stop
        self._on_force = on_force
        self._signals = tuple(signals)

    def received(self) -> None:
        """One stop signal arrived."""
        if self.stop.is_set():
            self.force.set()
            if self._on_force is not None:
                self._on_force()
            return
        self.stop.set()
        if self._on_stop is not None:
            self._on_stop()

    def _handle(self, signum: int, frame: object) -> None:
        self.received()

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        previous = {s: signal.signal(s, self._handle) for s in self._signals}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextmanager
    def installed_on(self, loop: Any) -> Iterator[StopSignals]:
        """On an asyncio (or uvloop) loop: the callbacks run in the loop, not in a signal
        handler. Outside the main thread, where asyncio refuses, nothing is installed."""
        added = []
        for s in self._signals:
            try:
                loop.add_signal_handler(s, self.received)
            except (ValueError, RuntimeError, NotImplementedError):
                continue
            added.append(s)
        try:
            yield self
        finally:
            for s in added:
                loop.remove_signal_handler(s)
