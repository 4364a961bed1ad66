"""The wire contract shared by the gateway and the workers, and the command line's contracts.

Everything that crosses Redis is named or encoded here: key and stream names (`keys`), tensors
(`tensor`), request and result messages (`messages`), worker advertisements (`registry`),
deadlines and the shared clock (`deadline`), and result-cache keys (`cachekey`). So are the
contracts every command keeps, loadgen's included: flags and `INFERQ_*` variables declared once
(`options`, `argtypes`) and exit statuses (`exits`). Nothing in this package does I/O.
"""

from protocol.errors import ProtocolError, VersionMismatch

PROTOCOL_VERSION = 2
"""Bumped on any incompatible change to a message or to the key layout; every message carries
it. 2: hash-tagged keys for Redis Cluster, model partitions."""

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "VersionMismatch"]
