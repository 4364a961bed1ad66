"""Errors raised while encoding or decoding the wire contract."""

import reprlib


class ProtocolError(ValueError):
    """A message or tensor that does not follow the wire contract.

    Decoding anything malformed raises this and nothing else, so callers can catch one type.
    """


class VersionMismatch(ProtocolError):
    """A message written by a process speaking another protocol version."""

    def __init__(self, got: object, expected: int) -> None:
        super().__init__(
            f"message has protocol version {reprlib.repr(got)} but this process speaks "
            f"version {expected}; "
            "upgrade the gateway and the workers to the same inferq release"
        )
        self.got = got
        self.expected = expected
