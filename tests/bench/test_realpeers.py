"""bench/realpeers/run.py's verdicts: issue #27's targets from cells of one round."""

from __future__ import annotations

from typing import Any

from bench.realpeers.run import PEERS, process_name, targets


def row(
    target: str,
    rps: float,
    *,
    model: str = "digits",
    c: int = 128,
    round_: int = 0,
    cpu: float = 500.0,
    p50: float = 1.0,
    **extra: Any,
) -> dict[str, Any]:
    peer, _, encoding = target.rpartition("-")
    return {
        "model": model,
        "concurrency": c,
        "round": round_,
        "target": target,
        "peer": peer,
        "encoding": encoding,
        "rps": rps,
        "p50_ms": p50,
        "cpu_us_per_request": {"server": cpu},
        **extra,
    }


def verdict(results: list[dict[str, Any]], name: str, round_: int = 1) -> dict[str, Any]:
    (found,) = [t for t in results if t["target"] == name and t["round"] == round_]
    return found


def test_inferq_is_compared_with_the_best_other_row_of_the_same_round_only() -> None:
    runs = [
        row("inferq-json", 1300),
        row("inferq-binary", 1500),
        row("triton-binary", 1000),
        row("kserve-json", 900),
        # A faster peer in another round does not count against round 1.
        row("triton-binary", 5000, round_=1),
        row("inferq-json", 1000, round_=1),
    ]
    results = targets(runs)
    json1 = verdict(results, "digits c=128: inferq json / the best peer")
    assert (json1["value"], json1["met"]) == (1.3, True)
    assert "triton-binary 1000" in json1["note"]
    binary1 = verdict(results, "digits c=128: inferq binary / the best peer")
    assert (binary1["value"], binary1["met"]) == (1.5, False)
    assert verdict(results, "digits c=128: inferq json / the best peer", 2)["value"] == 0.2


def test_cpu_per_answer_is_held_against_the_most_frugal_batching_peer() -> None:
    runs = [
        row("inferq-json", 2000, cpu=600),
        row("fastapi-json", 2000, cpu=300),  # no batching: not the yardstick
        row("kserve-binary", 900, cpu=200),  # no batching either
        row("batcher-binary", 1800, cpu=540),
        row("triton-json", 900, cpu=1200),
    ]
    cpu = verdict(
        targets(runs),
        "digits c=128: inferq json CPU per answer / the most frugal batching peer's",
    )
    assert (cpu["value"], cpu["met"]) == (round(600 / 540, 3), False)
    assert "batcher-binary 540" in cpu["note"]


def test_c1_is_held_against_plain_fastapi_and_c64_against_the_batcher() -> None:
    runs = [
        row("inferq-json", 500, c=1, p50=1.9),
        row("fastapi-json", 1900, c=1, p50=0.5),
        row("inferq-json", 1800, c=64, redis_commands_per_request=2.3),
        row("batcher-json", 1200, c=64),
    ]
    results = targets(runs)
    assert verdict(results, "digits c=1: P50 inferq JSON / FastAPI")["value"] == 3.8
    assert verdict(results, "digits c=1: req/s inferq JSON / FastAPI")["met"] is False
    assert verdict(results, "digits c=64: inferq JSON / the in-process batcher")["value"] == 1.5
    redis = verdict(results, "digits c=64: Redis commands per request, inferq json")
    assert (redis["value"], redis["met"]) == (2.3, True)


def test_this_checkouts_servers_run_in_the_rounds_beside_the_real_peers() -> None:
    assert [n for n, p in PEERS.items() if p.checkout] == ["inferq", "fastapi", "batcher"]
    assert PEERS["fastapi"].module == ["bench.peer_servers", "plain"]
    assert PEERS["triton"].module == ["bench.realpeers.triton_server"]


def test_inferq_processes_are_named_by_their_subcommand(monkeypatch: Any) -> None:
    import bench.realpeers.run as run

    class FakePath:
        def __init__(self, path: str) -> None:
            self.path = path

        def read_text(self) -> str:
            return "python3.11\n"

        def read_bytes(self) -> bytes:
            return b"\0".join([b"python", b"-m", b"inferq", b"worker", b"--redis", b"x"])

    monkeypatch.setattr(run, "Path", FakePath)
    assert process_name(1) == "inferq worker"
