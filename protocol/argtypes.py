"""Argument types for the command line: each raises ValueError, which argparse reports as a
usage error naming the flag."""

from __future__ import annotations


def positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError(raw)
    return value


def non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(raw)
    return value


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError(raw)
    return value


def non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise ValueError(raw)
    return value


def port_or_off(raw: str) -> int:
    """A TCP port, or 0 for off."""
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError(raw)
    return value


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def boolean(raw: str) -> bool:
    """A switch's variable: 1/true/yes/on or 0/false/no/off (any case; empty is off)."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(raw)
