"""inferq: queue-driven distributed inference over Redis Streams.

This package holds what both processes share at run time (Redis connections, the Redis clock,
logging set-up) and the ``inferq`` command line. The wire contract lives in ``protocol``, the
gateway in ``producer`` and the workers in ``consumer``.
"""

__version__ = "0.1.0"
