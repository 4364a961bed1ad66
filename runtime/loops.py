"""The background loops of one process: started, owned and stopped here, and asked for health.

A gateway and a worker each own one ``Loops``. ``spawn`` starts a loop as a task and keeps a
strong reference to it; ``backoff`` hands a loop its ``Backoff`` (see ``runtime.backoff``).
A loop has exactly two outcomes for an error: a Redis error is retried with backoff inside the
loop, and anything else that ends it (a bug) makes it *down*: ``on_fatal`` is called with the
reason, and the owner ends its process with a non-zero status so that its supervisor restarts
it. ``problems()`` lists what is down or failing, for readiness and the loop gauges.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from runtime.backoff import Backoff


class LoopCrashed(RuntimeError):
    """A background loop ended with an error that is not a Redis error."""


class Loops:
    def __init__(self, log: Any, *, on_fatal: Callable[[str], None] | None = None) -> None:
        self._log = log
        self._on_fatal = on_fatal
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._backoffs: dict[str, Backoff] = {}
        self._extra: set[asyncio.Task[Any]] = set()
        self.down: dict[str, str] = {}
        """Loops that ended with a bug, and why."""

    def backoff(self, name: str, *, critical: bool = True, **options: Any) -> Backoff:
        """The backoff (and health) of the loop called ``name``; made once, then shared."""
        found = self._backoffs.get(name)
        if found is None:
            found = self._backoffs[name] = Backoff(name, self._log, critical=critical, **options)
        return found

    def backoffs(self) -> list[Backoff]:
        """Every loop's backoff made so far (``runtime.wedge`` reads how long each fails)."""
        return list(self._backoffs.values())

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a long-lived loop. It should only end when cancelled."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        task.add_done_callback(self._ended)
        return task

    def spawn_once(self, name: str, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a short helper task (kept referenced until it ends; its errors are logged)."""
        task = asyncio.create_task(coro, name=name)
        self._extra.add(task)
        task.add_done_callback(self._helper_done)

    def names(self) -> list[str]:
        return list(self._tasks)

    def problems(self, *, critical_only: bool = False) -> list[str]:
        """``"name: why"`` for every loop that is down or whose last attempt failed."""
        out = [f"{name}: down ({why})" for name, why in self.down.items()]
        for name, backoff in self._backoffs.items():
            if backoff.problem is not None and (backoff.critical or not critical_only):
                out.append(f"{name}: {backoff.problem}")
        return out

    def health(self) -> dict[str, bool]:
        """Per loop, whether it is up and its last attempt succeeded (for the loop gauge)."""
        status = {name: name not in self.down for name in self._tasks}
        for name, backoff in self._backoffs.items():
            status[name] = status.get(name, True) and backoff.healthy
        return status

    async def cancel(self, names: Iterable[str] | None = None) -> None:
        """Cancel the named loops (all, and every helper, by default) and wait for them."""
        chosen = list(self._tasks) if names is None else [n for n in names if n in self._tasks]
        tasks = [self._tasks.pop(n) for n in chosen]
        if names is None:
            tasks += list(self._extra)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        name = task.get_name()
        if self._tasks.get(name) is not task:
            return  # stopped by ``cancel`` (a loop may return instead of raising when cancelled)
        del self._tasks[name]
        if task.cancelled():
            return
        error = task.exception()
        why = f"{type(error).__name__}: {error}" if error is not None else "it returned"
        self.down[name] = why
        self._log.error(
            f"background loop '{name}' ended ({why}); exiting so that a supervisor restarts "
            "the process",
            loop=name,
            exc_info=error,
        )
        if self._on_fatal is not None:
            self._on_fatal(f"loop '{name}' ended: {why}")

    def _helper_done(self, task: asyncio.Task[Any]) -> None:
        self._extra.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.warning(
                "helper task failed", task=task.get_name(), error=str(task.exception())
            )
