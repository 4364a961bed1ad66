"""The wire contract shared by the gateway and the workers.

Everything that crosses Redis is named or encoded here: key and stream names (`keys`), tensors
(`tensor`), request and result messages (`messages`), worker advertisements (`registry`),
deadlines and the shared clock (`deadline`), and result-cache keys (`cachekey`). Nothing in this
package does I/O.
"""

from protocol.errors import ProtocolError, VersionMismatch

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change to a message; every message carries it."""

__all__ = ["PROTOCOL_VERSION", "ProtocolError", "VersionMismatch"]
