"""The model control plane: which versions serve, with what traffic weights, and how a change
reaches every worker.

A change is a two-phase commit driven by the gateway that received the admin call:

1. ``PREPARE`` on the control stream (``Keys.control``): every worker serving the model loads and
   warms the versions of the new policy *beside* the ones it serves, and reports back
   (``LoadReport`` pushed onto the command's reply list). Nothing routes to the new versions yet.
2. If every live worker loaded them: the policy is written to ``Keys.policies`` and ``COMMIT`` is
   sent; gateways route by it from then on, and workers retire versions the policy dropped once
   requests already routed to them have had time to finish. If any worker failed: ``ABORT``; the
   workers drop what they loaded for it and keep serving the old policy, and the errors go back
   to the admin call and into the model's status (``Keys.model_status``).

A worker that starts later reads the committed policy before it serves; one that cannot serve
it (a version it names has no folder) serves the repository config's versions instead and says
so (``LoadReport.fallback``). A reset is the same two phases for the config's own versions, and
its commit deletes the stored policy instead of writing one. A PREPARE also reaches the workers
that do not serve the model but whose repository holds it: that is how a new model is loaded.
``VersionPolicy`` also describes a repository config's own policy (``[version_policy]``) when no
admin call set one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from protocol.envelope import pack, unpack
from protocol.errors import ProtocolError
from protocol.keys import is_valid_name

COMMAND_FIELD = b"c"
"""The one field of a control-stream entry."""


def version_order(version: str) -> tuple[int, int, str]:
    """Numeric versions in numeric order, then named ones alphabetically."""
    return (0, int(version), version) if version.isdigit() else (1, 0, version)


def check_weights(raw: Any, *, what: str = "weights") -> dict[str, float]:
    """Validate version -> traffic weight; the message says what is wrong for a person to fix.

    Weights are relative (90/10 and 9/1 are the same split); a weight of 0 keeps a version loaded
    and addressable by ``/versions/{v}`` without sending it default traffic.
    """
    if not isinstance(raw, dict) or not raw:
        raise ProtocolError(
            f'{what} must be an object mapping versions to numbers, e.g. {{"1": 90, "2": 10}}'
        )
    weights: dict[str, float] = {}
    for version, weight in raw.items():
        version = str(version)
        if not is_valid_name(version):
            raise ProtocolError(f"{what}: invalid version {version!r} (letters, digits, _ - .)")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ProtocolError(f"{what}: the weight of version {version} must be a number")
        if not math.isfinite(weight) or weight < 0:
            raise ProtocolError(
                f"{what}: the weight of version {version} must be finite and not negative"
            )
        weights[version] = float(weight)
    if sum(weights.values()) <= 0:
        raise ProtocolError(f"{what}: at least one version needs a positive weight")
    return weights


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """The versions a model serves and how default traffic splits between them."""

    versions: tuple[str, ...]
    """Loaded versions, oldest first. Empty: the model is unloaded."""
    weights: dict[str, float] = field(default_factory=dict)
    """Version -> relative share of requests that name no version. Empty: all to the newest."""
    generation: int = 0
    """Increases with every committed change (0: the repository config's own policy)."""

    def __post_init__(self) -> None:
        unknown = set(self.weights) - set(self.versions)
        if unknown:
            raise ProtocolError(f"weights name versions not served: {', '.join(sorted(unknown))}")

    @property
    def loaded(self) -> bool:
        return bool(self.versions)

    def traffic(self) -> dict[str, float]:
        """Every served version's share of default traffic, summing to 1."""
        if not self.versions:
            return {}
        if not self.weights:
            return {v: (1.0 if v == self.versions[-1] else 0.0) for v in self.versions}
        total = sum(self.weights.values())
        return {v: self.weights.get(v, 0.0) / total for v in self.versions}

    def wire(self) -> list[Any]:
        return [list(self.versions), self.weights, self.generation]

    @classmethod
    def from_wire(cls, item: Any) -> VersionPolicy:
        if not (isinstance(item, list) and len(item) == 3):
            raise ProtocolError("version policy is not a [versions, weights, generation] list")
        versions, weights, generation = item
        if not isinstance(versions, list) or not all(
            isinstance(v, str) and is_valid_name(v) for v in versions
        ):
            raise ProtocolError("version policy: versions must be valid version names")
        if not _is_int(generation):
            raise ProtocolError("version policy: generation must be an integer")
        return cls(
            tuple(versions),
            check_weights(weights, what="version policy weights") if weights else {},
            generation,
        )

    def encode(self) -> bytes:
        return pack(self.wire())

    @classmethod
    def decode(cls, raw: bytes) -> VersionPolicy:
        return cls.from_wire(unpack(raw, "version policy", 3))


class Op(StrEnum):
    PREPARE = "prepare"
    """Load and warm the policy's versions beside the current ones; report back."""
    COMMIT = "commit"
    """The policy is committed: serve it, retire versions it dropped."""
    ABORT = "abort"
    """The prepare failed somewhere: drop what was loaded for it, keep the current policy."""


@dataclass(frozen=True, slots=True)
class Command:
    """One entry of the control stream."""

    op: Op
    model: str
    policy: VersionPolicy
    reply_to: str = ""
    """List key workers push their ``LoadReport`` onto (PREPARE only)."""

    def encode(self) -> bytes:
        return pack([self.op.value, self.model, self.policy.wire(), self.reply_to])

    @classmethod
    def decode(cls, raw: bytes) -> Command:
        op, model, policy, reply_to = unpack(raw, "control command", 4)
        try:
            parsed_op = Op(op)
        except ValueError:
            raise ProtocolError(f"control command: unknown op {op!r}") from None
        if not isinstance(model, str) or not is_valid_name(model):
            raise ProtocolError("control command: invalid model name")
        if not isinstance(reply_to, str):
            raise ProtocolError("control command: reply_to must be a string")
        return cls(parsed_op, model, VersionPolicy.from_wire(policy), reply_to)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one worker did with one model: the answer to a PREPARE, and its line in the
    model's status hash."""

    worker: str
    model: str
    generation: int
    ok: bool
    versions: tuple[str, ...]
    """Versions this worker has loaded after the command (ready to serve)."""
    error: str = ""
    load_ms: float = 0.0
    updated_ms: int = 0
    weights: dict[str, float] = field(default_factory=dict)
    """The traffic weights of the config it loaded (a load by the repository config)."""
    fallback: str = ""
    """Why this worker serves the repository config instead of the committed policy ("" when
    it serves the policy): a version the policy names has no folder, or does not load."""

    def encode(self) -> bytes:
        return pack(
            [
                self.worker,
                self.model,
                self.generation,
                self.ok,
                list(self.versions),
                self.error,
                self.load_ms,
                self.updated_ms,
                self.weights,
                self.fallback,
            ]
        )

    @classmethod
    def decode(cls, raw: bytes) -> LoadReport:
        fields = unpack(raw, "load report", 10)
        worker, model, generation, ok, versions, error, load_ms, updated, weights, fallback = fields
        if not isinstance(worker, str) or not isinstance(model, str):
            raise ProtocolError("load report: worker and model must be strings")
        if not _is_int(generation) or not isinstance(ok, bool) or not isinstance(error, str):
            raise ProtocolError("load report: invalid generation, ok or error")
        if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
            raise ProtocolError("load report: versions must be strings")
        if not isinstance(load_ms, int | float) or not _is_int(updated):
            raise ProtocolError("load report: invalid load_ms or updated_ms")
        if not isinstance(fallback, str):
            raise ProtocolError("load report: fallback must be a string")
        return cls(
            worker,
            model,
            generation,
            ok,
            tuple(versions),
            error,
            float(load_ms),
            updated,
            check_weights(weights, what="load report weights") if weights else {},
            fallback,
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
