"""What Triton clients ask about a model besides its metadata: its configuration (``GET
/v2/models/{m}[/versions/{v}]/config``, gRPC ``ModelConfig``) and its statistics (``GET
/v2/models[/{m}[/versions/{v}]]/stats``, gRPC ``ModelStatistics``), in Triton's JSON shapes.

Both transports take the same documents: HTTP answers them as JSON, gRPC parses them into its
messages (``google.protobuf.json_format``), so a field is spelled once, here.

The configuration is what the workers advertise (``protocol.registry.ModelMetadata``), for a
served model or, for one not loaded yet, as its repository config would serve it. Statistics
are the live workers' counters (``protocol.modelstats``), summed at each call: one
``ZRANGEBYSCORE`` and one ``MGET``, never anything per request.
"""

from __future__ import annotations

from typing import Any, cast

import redis.asyncio as aioredis

from producer.errors import NotFound
from producer.registry import ModelRegistry
from protocol.control import version_order
from protocol.keys import Keys, is_valid_name
from protocol.modelstats import VersionStats, summed
from protocol.registry import ModelMetadata, TensorSpec


def triton_datatype(datatype: str) -> str:
    """The V2 datatype as Triton's config names it (``BYTES`` is Triton's ``TYPE_STRING``)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    # Triton's dims leave out the batch dimension when max_batch_size > 0 (inferq's always is).
    dims = list(spec.shape[1:])
    return {"name": spec.name, "data_type": triton_datatype(spec.datatype), "dims": dims}


def config_document(meta: ModelMetadata) -> dict[str, Any]:
    """Triton's model configuration JSON, in the part inferq has."""
    doc: dict[str, Any] = {
        "name": meta.name,
        "platform": meta.platform,
        "backend": meta.backend,
        "max_batch_size": meta.max_batch,
        "input": [_tensor(s) for s in meta.inputs],
        "output": [_tensor(s) for s in meta.outputs],
        "dynamic_batching": {"max_queue_delay_microseconds": round(meta.flush_ms * 1000)},
        "response_cache": {"enable": meta.cache_enabled},
        "parameters": {
            key: {"string_value": str(value)}
            for key, value in (
                ("default_timeout_ms", meta.default_timeout_ms),
                ("cache_ttl_s", meta.cache_ttl_s),
                ("partitions", meta.partitions),
                ("versions", ",".join(meta.versions)),
                ("default_version", meta.default_version),
            )
        },
    }
    if meta.versions and all(v.isdigit() for v in meta.versions):
        # Triton's version numbers are integers; named versions have no place here.
        doc["version_policy"] = {"specific": {"versions": [int(v) for v in meta.versions]}}
    return doc


class Introspection:
    def __init__(self, keys: Keys, redis: aioredis.Redis, registry: ModelRegistry) -> None:
        self._keys = keys
        self._redis = redis
        self._registry = registry

    async def config(self, model: str, version: str | None = None) -> dict[str, Any]:
        """The model's configuration (404 for a model no live worker serves or holds, or a
        version it does not serve)."""
        entry = await self._registry.lookup(model) if is_valid_name(model) else None
        held = self._registry.repository.get(model)
        if entry is not None and entry.metadata.versions:
            meta = entry.metadata
        elif held is not None and held.metadata is not None:
            meta = held.metadata
        elif entry is not None:
            meta = entry.metadata
        else:
            raise NotFound(f"unknown model '{model}' (models known: {self._known()})")
        if version and version not in meta.versions:
            raise NotFound(
                f"model '{model}' has no version '{version}' (versions: "
                f"{', '.join(meta.versions) or 'none'})"
            )
        return config_document(meta)

    async def statistics(
        self, model: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        """``{"model_stats": [...]}``: per version of every model (or of ``model``, or just
        ``version``), the live workers' counters summed; a served version that has run nothing
        yet is listed with zeros."""
        registry = self._registry
        await registry.refresh()
        if model and model not in registry.models and model not in registry.repository:
            raise NotFound(f"unknown model '{model}' (models known: {self._known()})")
        workers = [w.id for w in registry.live_worker_infos()]
        raws: list[bytes | None] = []
        if workers:
            # One slot holds every worker's key (the control plane's), which is all MGET needs.
            keys = [self._keys.worker_stats(w) for w in workers]
            raws = cast(list[bytes | None], await self._redis.mget(keys))
        totals = summed(raws)
        for name, entry in registry.models.items():
            if entry.ready:
                for v in entry.metadata.versions:
                    totals.version(name, v)
        if model and version and version not in totals.models.get(model, {}):
            raise NotFound(f"model '{model}' has no version '{version}' served or counted")
        rows: list[dict[str, Any]] = []
        for name in sorted(totals.models):
            if model and name != model:
                continue
            versions: dict[str, VersionStats] = totals.models[name]
            for v in sorted(versions, key=version_order):
                if not version or v == version:
                    rows.append(versions[v].json(name, v))
        return {"model_stats": rows}

    def _known(self) -> str:
        names = {*self._registry.models, *self._registry.repository}
        return ", ".join(sorted(names)) or "none"
