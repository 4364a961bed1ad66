"""What the gateway and the workers share at run time, below both and above ``protocol``:
Redis connections and the Redis clock (``connections``), asyncio helpers (``aio``), logging
set-up (``logging``), Prometheus helpers (``metrics``) and the stream-backlog collector (``lag``).

Imports point down only: ``protocol`` -> ``runtime`` -> ``producer`` | ``consumer`` -> the
``inferq`` command line. Nothing here imports the gateway, the worker or the CLI.
"""

__version__ = "0.1.0"
"""The inferq release; keep ``pyproject.toml`` in step."""
