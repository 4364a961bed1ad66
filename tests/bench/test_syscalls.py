"""bench/syscalls.py reads strace -c's table."""

from __future__ import annotations

from bench.syscalls import parse_summary

TABLE = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 45.00    0.000450          10        45           epoll_pwait
 20.00    0.000200           5        40         3 read
 10.00    0.000100           2        35           write
------ ----------- ----------- --------- --------- ----------------
100.00    0.001000           8       120         3 total
"""


def test_calls_are_read_per_syscall_with_or_without_an_errors_column() -> None:
    assert parse_summary(TABLE) == {"epoll_pwait": 45, "read": 40, "write": 35}


def test_a_table_with_nothing_traced_reads_empty() -> None:
    assert parse_summary("") == {}
