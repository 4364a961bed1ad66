"""The ``inferq`` command line, the top layer: ``up``, ``gateway``, ``worker``, ``lag``,
``dlq``, ``models`` and ``loadgen``.

The wire contract lives in ``protocol``, the shared run-time pieces in ``runtime``, the gateway in
``producer`` and the workers in ``consumer``; this package wires them into processes.
"""

from runtime import __version__

__all__ = ["__version__"]
