"""Small asyncio helpers shared by the gateway and the worker."""

from __future__ import annotations

import asyncio


def cancelling() -> bool:
    """Whether the current task has been asked to stop.

    redis-py can turn a cancellation that arrives mid-command into a ConnectionError. A
    background loop that retries on connection errors would then swallow its own cancellation
    and run forever; such loops test this instead of ``while True``.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
