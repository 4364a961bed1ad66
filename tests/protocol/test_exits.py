"""How a process ends: one table of exit statuses, and the stop rule (the first signal stops
gracefully, a second forces) for every long-running command."""

from __future__ import annotations

import asyncio
import os
import signal

from protocol import exits
from protocol.exits import StopSignals


def test_the_statuses_a_supervisor_acts_on_are_distinct() -> None:
    named = {k: v for k, v in vars(exits).items() if k.startswith("EXIT_")}
    assert named["EXIT_OK"] == 0 and named["EXIT_USAGE"] == 2
    assert named["EXIT_LOOP_FAILED"] == 70 and named["EXIT_INTERRUPTED"] == 130
    aliases = {"EXIT_NOT_FOUND"}  # the same status as EXIT_FAILED, by name for readers
    values = [v for k, v in named.items() if k not in aliases]
    assert len(values) == len(set(values))


def test_the_first_signal_asks_to_stop_and_a_second_forces() -> None:
    calls: list[str] = []
    signals = StopSignals(on_stop=lambda: calls.append("stop"), on_force=lambda: calls.append("x"))
    signals.received()
    assert signals.stop.is_set() and not signals.force.is_set() and calls == ["stop"]
    signals.received()
    assert signals.force.is_set() and calls == ["stop", "x"]


def test_installed_handlers_are_restored_afterwards() -> None:
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals()
    with signals.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.stop.wait(5)
    assert signal.getsignal(signal.SIGTERM) is before


def test_on_an_event_loop_the_callbacks_run_in_the_loop() -> None:
    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        signals = StopSignals(on_stop=stopped.set, signals=(signal.SIGUSR1,))
        with signals.installed_on(loop):
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.wait_for(stopped.wait(), 5)
        return signals.stop.is_set(), signals.force.is_set()

    assert asyncio.run(main()) == (True, False)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
