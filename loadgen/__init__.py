"""inferq's load generator: a lean HTTP/1.1 client, closed and open load loops, and reports.

Modules:

* :mod:`loadgen.http` — :class:`HTTPConnection` (raw asyncio protocol), :func:`prepare`,
  :class:`PreparedRequest`, :func:`run` (asyncio on uvloop when installed);
* :mod:`loadgen.stats` — :class:`LatencyHistogram` (an HdrHistogram, 3 significant figures),
  :class:`RequestStats`;
* :mod:`loadgen.recorder` — :class:`Recorder` (what a run records into, with a per-second
  timeline), read live by :mod:`loadgen.progress`;
* :mod:`loadgen.result` — :class:`LoadResult`, common to every load mode;
* :mod:`loadgen.loop` — :class:`LoadOptions` (target, workload, phases and limits of any run)
  and what the loops share;
* :mod:`loadgen.closed` — :func:`run_closed_loop` (C back-to-back workers);
* :mod:`loadgen.open` — :func:`run_open_loop` (Poisson arrivals, latency from intended send
  times), with rate schedules and ramps from :mod:`loadgen.schedule`;
* :mod:`loadgen.workload`, :mod:`loadgen.jobs` — what one unit of work is (a request, or an
  async job submitted and polled); :mod:`loadgen.inputs` — V2 bodies from model metadata or
  a file, JSON or binary tensors;
* :mod:`loadgen.report` — the self-contained HTML report; :mod:`loadgen.charts` — its charts and
  the PNG, drawn with matplotlib when the ``inferq[charts]`` extra is installed;
* :mod:`loadgen.cli` — ``inferq loadgen`` (``python -m loadgen``), its flags in
  :mod:`loadgen.settings`;
* ``loadgen/locustfile.py`` — the same workloads for Locust users (``inferq[locust]``).
"""

from loadgen.closed import run_closed_loop
from loadgen.http import HTTPConnection, PreparedRequest, Response, prepare, run
from loadgen.loop import LoadOptions
from loadgen.open import run_open_loop
from loadgen.recorder import Recorder
from loadgen.result import LoadResult
from loadgen.schedule import RateSchedule
from loadgen.stats import LatencyHistogram, RequestStats

__all__ = [
    "HTTPConnection",
    "LatencyHistogram",
    "LoadOptions",
    "LoadResult",
    "PreparedRequest",
    "RateSchedule",
    "Recorder",
    "RequestStats",
    "Response",
    "prepare",
    "run",
    "run_closed_loop",
    "run_open_loop",
]
