"""inferq's load generator: a lean HTTP/1.1 keep-alive client and load loops.

Modules:

* :mod:`loadgen.http` — :class:`HTTPConnection` (raw asyncio protocol), :func:`prepare`,
  :class:`PreparedRequest`, :func:`run` (asyncio on uvloop when installed);
* :mod:`loadgen.stats` — :class:`LatencyHistogram` (log-linear, ~0.4%), :class:`RequestStats`;
* :mod:`loadgen.result` — :class:`LoadResult`, common to every load mode;
* :mod:`loadgen.closed` — :func:`run_closed_loop` (C back-to-back workers).

``python -m loadgen --help`` runs a closed loop from the command line.
"""

from loadgen.closed import run_closed_loop
from loadgen.http import HTTPConnection, PreparedRequest, Response, prepare, run
from loadgen.result import LoadResult
from loadgen.stats import LatencyHistogram, RequestStats

__all__ = [
    "HTTPConnection",
    "LatencyHistogram",
    "LoadResult",
    "PreparedRequest",
    "RequestStats",
    "Response",
    "prepare",
    "run",
    "run_closed_loop",
]
