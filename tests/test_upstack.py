"""``tests.upstack``'s own contract: a wait that fails says what it waited for, how the process
ended, and what it printed last on each stream (a process that printed nothing included)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.upstack import UpProcess


def process(code: str) -> UpProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return UpProcess(proc, port=0, namespace="unused")


def test_a_wait_on_a_process_that_exited_fails_at_once_with_its_status_and_both_streams():
    u = process("import sys; print('out line'); print('err line', file=sys.stderr); sys.exit(3)")
    with pytest.raises(AssertionError) as failure:
        u.wait_for(lambda: False, "the impossible", timeout_s=60)
    message = str(failure.value)
    assert "waiting for the impossible" in message and "exit status 3" in message
    assert "of stdout:\nout line" in message and "of stderr:\nerr line" in message


def test_a_wait_on_a_silent_process_still_says_what_it_waited_for():
    u = process("import time; time.sleep(30)")
    try:
        with pytest.raises(AssertionError) as failure:
            u.wait_for(lambda: False, "a word", timeout_s=0.2)
    finally:
        u.proc.kill()
        u.proc.wait()
        u.join()
    message = str(failure.value)
    assert "timed out after 0.2 s waiting for a word (still running)" in message
    assert "of stdout:\n(nothing)" in message and "of stderr:\n(nothing)" in message


def test_a_wait_sees_the_last_line_a_process_printed_before_it_exited():
    u = process("print('inferq is serving')")
    u.wait_for(lambda: "inferq is serving" in u.stdout, "the line", timeout_s=10)
    assert u.proc.wait(10) == 0  # reaped: an unreaped Popen warns when it is collected
    u.join()
