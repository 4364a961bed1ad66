"""A process's end, bounded: ``run`` is ``asyncio.run``, except that closing the event loop once
the service has stopped may take ``close_within_s`` at most; ``exit`` is ``sys.exit``, except
that the interpreter's shutdown (joining threads, ``atexit``) may take as long at most.

Why: closing a loop waits for work that no cancellation reaches. uvloop's ``close`` runs libuv
until its pending address lookups end, and asyncio's waits for the default executor's threads
(Python 3.11 without a timeout). A Redis connection attempt that resolves a host name, such as
``redis`` under Compose once the Redis container is gone, can sit in a DNS timeout for tens of
seconds, so a gateway or worker that had stopped cleanly (everything answered and acknowledged)
was still there when its engine's stop grace ran out, and was SIGKILLed (exit 137). Past the
bound the process says why on stderr and exits at once with the code its outcome calls for. The
same holds for a thread that no one stops, which the interpreter joins at exit.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

CLOSE_WITHIN_S = 5.0
"""How long closing the loop may take once the main coroutine has ended."""


def run(
    main: Coroutine[Any, Any, Any],
    *,
    exit_code: Callable[[BaseException | None], int],
    what: str,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    close_within_s: float = CLOSE_WITHIN_S,
) -> None:
    """Run ``main`` on a new loop (``loop_factory``'s, else asyncio's) and close the loop. If
    the close takes longer than ``close_within_s``, exit the process with ``exit_code`` of how
    ``main`` ended (None: it returned; else what it raised). ``what`` names the process in the
    message. Otherwise it returns, or raises what ``main`` raised, as ``asyncio.run`` does."""
    runner = asyncio.Runner(loop_factory=loop_factory)
    outcome: BaseException | None = None
    try:
        runner.run(main)
    except BaseException as e:
        outcome = e
        raise
    finally:
        deadline = _deadline(close_within_s, exit_code(outcome), what, "closing its event loop")
        try:
            runner.close()
        finally:
            deadline.cancel()


def exit(code: int, *, what: str, within_s: float = CLOSE_WITHIN_S) -> NoReturn:
    """``sys.exit(code)``; if the interpreter's shutdown then takes longer than ``within_s``
    (a non-daemon thread that never ends), the process exits at once with ``code``. For a
    process's entry point only: the deadline outlives the call."""
    _deadline(within_s, code, what, "its interpreter's shutdown")
    sys.exit(code)


def _deadline(seconds: float, code: int, what: str, step: str) -> threading.Timer:
    """A daemon timer that ends the process with ``code`` after ``seconds``, started."""
    timer = threading.Timer(seconds, _exit_now, args=(what, step, seconds, code))
    timer.daemon = True
    timer.start()
    return timer


def _exit_now(what: str, step: str, seconds: float, code: int) -> None:
    print(
        f"{what}: stopped, but {step} took longer than {seconds:g} s (a Redis address lookup "
        "or a thread still running); exiting without waiting for it",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(code)
