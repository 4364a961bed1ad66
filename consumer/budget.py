"""An on-demand worker's model budget: which loaded models to unload, least recently used
first, so that one more fits under ``--max-loaded-models`` and ``--max-model-memory-mib``.

Pure logic: the worker hands in what it holds (each model's resident bytes, measured when it
loaded, and when a request for it was last read) and gets back the names to unload. Memory is
the figure measured at load, not the process's RSS now: an unloaded model's memory is not
always given back to the operating system at once (allocator arenas), so the current RSS would
count a model twice or make room that is not there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Held:
    """A loaded model, as the budget sees it."""

    resident_bytes: int
    """What loading it added to the process's resident memory (0 when not measured)."""
    used_at: float
    """When a request for it was last read (monotonic); its load time until then."""


@dataclass(frozen=True, slots=True)
class LoadBudget:
    max_models: int = 0
    """Most models held at once (0: no limit)."""
    max_bytes: int = 0
    """Most resident bytes the held models may add up to (0: no limit)."""

    @classmethod
    def of(cls, max_loaded_models: int, max_memory_mib: float) -> LoadBudget:
        """From the worker's ``--max-loaded-models`` and ``--max-model-memory-mib``."""
        return cls(max_loaded_models, int(max_memory_mib * MIB))

    def to_unload(
        self, held: Mapping[str, Held], incoming_bytes: int = 0, *, keep: str = ""
    ) -> list[str]:
        """The models to unload, least recently used first, before one more of about
        ``incoming_bytes`` loads (0 when not known yet: it counts one model). ``keep`` is never
        chosen (the model just loaded, when checking after a load). When even unloading
        everything else cannot make room the model still loads: a worker serves a model that
        does not fit rather than none."""
        order = sorted((n for n in held if n != keep), key=lambda n: held[n].used_at)
        models = len(held) + (0 if keep else 1)
        used = sum(h.resident_bytes for h in held.values()) + incoming_bytes
        chosen: list[str] = []
        for name in order:
            if not self._over(models, used):
                break
            chosen.append(name)
            models -= 1
            used -= held[name].resident_bytes
        return chosen

    def _over(self, models: int, used: int) -> bool:
        too_many = self.max_models > 0 and models > self.max_models
        too_big = self.max_bytes > 0 and used > self.max_bytes
        return too_many or too_big
