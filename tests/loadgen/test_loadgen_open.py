"""The open loop: Poisson arrivals, latency from intended send times, a bounded pool."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from loadgen.loop import LoadOptions
from loadgen.open import TIMEOUT_BEFORE_SEND, run_open_loop
from loadgen.recorder import Recorder
from loadgen.schedule import RateSchedule

# serial: measures durations and latencies.
pytestmark = pytest.mark.serial


def test_open_loop_sends_the_scheduled_arrivals(tiny_server, response_bytes) -> None:
    async def main() -> None:
        async with tiny_server(lambda req: response_bytes(b"{}")) as srv:
            res = await run_open_loop(
                LoadOptions(
                    srv.url + "/v2/models/m/infer",
                    duration_s=0.25,
                    warmup_s=0.05,
                    body=b'{"inputs": []}',
                    headers={"content-type": "application/json"},
                ),
                400,
                seed=3,
            )
        assert res.mode == "open"
        assert res.target_rps == pytest.approx(400)
        assert 60 <= res.requests <= 140  # ~100 expected
        assert res.ok == res.requests and res.errors == {}
        assert len(srv.requests) == res.requests + res.warmup_requests
        assert {r.path for r in srv.requests} == {"/v2/models/m/infer"}
        assert res.duration_s == pytest.approx(0.25, abs=0.05)
        assert res.offered_rps == pytest.approx(res.requests / res.duration_s, rel=0.1)
        assert res.service_ms is not None and res.send_lag_ms is not None
        assert res.latency_ms["p50"] is not None and res.latency_ms["p50"] > 0
        assert 1 <= res.concurrency <= 512
        d = json.loads(json.dumps(res.to_dict()))
        assert d["mode"] == "open" and d["schedule"] == "400/s"
        assert sum(row["requests"] for row in d["timeline"]) == res.requests

    asyncio.run(main())


def test_latency_counts_queueing_from_the_intended_send_time(tiny_server, response_bytes) -> None:
    # One connection, a server that takes 10 ms per request, arrivals at ~500/s: requests
    # pile up behind each other. A closed loop (or a latency taken from the actual write)
    # would report ~10 ms; from the intended times the queueing shows.
    async def handler(req: Any) -> bytes:
        await asyncio.sleep(0.01)  # the server's service time
        return response_bytes()

    async def main() -> None:
        async with tiny_server(handler) as srv:
            res = await run_open_loop(
                LoadOptions(srv.url, duration_s=0.1, warmup_s=0, method="GET"),
                500,
                max_connections=1,
            )
        assert res.ok == res.requests >= 25
        assert srv.connections == 1 and res.concurrency == 1
        assert res.service_ms is not None
        service_p50 = res.service_ms["p50"]
        assert service_p50 is not None and 9 < service_p50 < 60
        latency = res.latency_ms
        assert latency["p50"] is not None and latency["max"] is not None
        assert latency["p50"] > 4 * service_p50
        # the last arrival (~0.1 s) waited behind all the others (~n x 10 ms of service)
        assert latency["max"] > res.requests * 10 * 0.5

    asyncio.run(main())


def test_the_pool_grows_to_keep_up_but_not_past_max_connections(
    tiny_server, response_bytes
) -> None:
    async def main() -> None:
        held = 0
        release = asyncio.Event()

        async def handler(req: Any) -> bytes:
            nonlocal held
            held += 1
            if held >= 3:  # answers only once three requests are in flight at once
                release.set()
            await release.wait()
            return response_bytes()

        rec = Recorder()
        async with tiny_server(handler) as srv:
            res = await run_open_loop(
                LoadOptions(srv.url, duration_s=0.01, warmup_s=0, method="GET"),
                2000,
                max_connections=3,
                connections=1,
                seed=5,
                recorder=rec,
            )
        assert res.ok == res.requests >= 3
        assert srv.connections == 3
        assert res.concurrency == rec.peak_connections == 3

    asyncio.run(main())


def test_requests_whose_time_runs_out_waiting_for_a_connection_are_never_sent(
    tiny_server,
) -> None:
    async def main() -> None:
        never = asyncio.Event()

        async def handler(req: Any) -> bytes:
            await never.wait()
            return b""

        started = time.perf_counter()
        async with tiny_server(handler) as srv:
            res = await run_open_loop(
                LoadOptions(srv.url, duration_s=0.03, warmup_s=0, method="GET", timeout_s=0.05),
                1000,
                max_connections=1,
                seed=1,
            )
        elapsed = time.perf_counter() - started
        assert res.ok == 0 and res.requests >= 10
        assert set(res.errors) <= {"RequestTimeout", TIMEOUT_BEFORE_SEND}
        assert res.errors.get(TIMEOUT_BEFORE_SEND, 0) > 0
        assert len(srv.requests) < res.requests  # not all of them were written
        assert elapsed < 2.0  # bounded by the last arrival plus the timeout

    asyncio.run(main())


def test_a_ramp_schedule_sends_the_expected_number_of_arrivals(tiny_server, response_bytes) -> None:
    async def main() -> None:
        schedule = RateSchedule.parse("200:2000:0.2s")
        async with tiny_server(lambda req: response_bytes()) as srv:
            res = await run_open_loop(
                LoadOptions(srv.url, duration_s=0.2, warmup_s=0, method="GET"), schedule, seed=2
            )
        assert res.target_rps == pytest.approx(1100)  # (200 + 2000) / 2
        assert 160 <= res.requests <= 280  # 220 expected
        assert res.schedule == "200->2000/s over 0.2s, then 2000/s"

    asyncio.run(main())


def test_max_requests_and_stop_end_the_run_early(tiny_server, response_bytes) -> None:
    async def main() -> None:
        async with tiny_server(lambda req: response_bytes()) as srv:
            res = await run_open_loop(
                LoadOptions(srv.url, duration_s=30, warmup_s=0, method="GET", max_requests=25), 2000
            )
            assert res.requests == res.ok == 25
            assert res.duration_s < 5

            stop = asyncio.Event()
            seen = 0

            def handler(req: Any) -> bytes:
                nonlocal seen
                seen += 1
                if seen >= 10:
                    stop.set()
                return response_bytes()

            srv.handler = handler
            res = await run_open_loop(
                LoadOptions(srv.url, duration_s=30, warmup_s=0, method="GET"), 2000, stop=stop
            )
            assert res.requests >= 10 and res.ok == res.requests
            assert res.duration_s < 5

    asyncio.run(main())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate": 0}, "rate"),
        ({"rate": -1}, "non-negative"),
        ({"duration_s": 0}, "duration_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_requests": 0}, "max_requests"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"rate": 10, "duration_s": 0.1} | kwargs
    loop_args = {k: args.pop(k) for k in ("rate", "max_connections") if k in args}
    with pytest.raises(ValueError, match=match):
        asyncio.run(run_open_loop(LoadOptions("http://127.0.0.1:9/", **args), **loop_args))
