"""runtime.runner: a process whose service has stopped exits even when closing its event loop
would wait (an address lookup or an executor thread that no cancellation reaches), with the
code its outcome calls for; a close that is quick is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from tests.support import checkout_env

SCRIPT = """
import asyncio, sys, threading, time
from runtime import runner

LOOPS = {"asyncio": None, "uvloop": __import__("uvloop").new_event_loop}

async def main(mode):
    if mode == "stuck":  # what a pending DNS lookup does to the close: work no cancel reaches
        asyncio.get_running_loop().run_in_executor(None, time.sleep, 60)
    if mode == "raises":
        raise ValueError("boom")

mode, loop = sys.argv[1], sys.argv[2]
if mode == "thread-left":  # a thread no one stops, which the interpreter joins at exit
    threading.Thread(target=time.sleep, args=(60,)).start()
    runner.exit(4, what="test process", within_s=0.5)
runner.run(main(mode), exit_code=lambda e: 7 if e is None else 9, what="test process",
           loop_factory=LOOPS[loop], close_within_s=0.5)
time.sleep(1)  # longer than the bound: a deadline left armed would end the process with 7
sys.exit(3)
"""


def run_script(mode: str, loop: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), mode, loop],
        capture_output=True,
        text=True,
        timeout=30,
        env=checkout_env(),
        check=False,
    )
    return done, time.monotonic() - started


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_close_that_would_wait_ends_the_process_with_its_outcomes_code(loop):
    done, took = run_script("stuck", loop)
    assert done.returncode == 7, done.stderr
    assert "closing its event loop took longer than 0.5 s" in done.stderr
    assert took < 20, f"the process waited {took:.1f} s for its executor thread"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_quick_close_returns_and_leaves_no_deadline_behind(loop):
    done, _ = run_script("returns", loop)
    assert (done.returncode, done.stderr) == (3, "")


def test_what_main_raised_is_raised_as_asyncio_run_would():
    done, _ = run_script("raises", "asyncio")
    assert done.returncode == 1 and "ValueError: boom" in done.stderr


def test_an_exit_that_a_thread_left_running_would_hold_up_ends_with_its_code():
    done, took = run_script("thread-left", "asyncio")
    assert done.returncode == 4, done.stderr
    assert "its interpreter's shutdown took longer than 0.5 s" in done.stderr
    assert took < 20
