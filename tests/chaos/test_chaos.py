"""The chaos suite: kill, stop and restart real worker processes under load, and count.

Every scenario sends requests with unique ids and checks each answer: sent / answered / lost /
duplicate / errors, printed as one figure line per scenario (``pytest -s`` shows them). Workers
are real ``inferq worker`` processes so they can be SIGKILLed; the gateway runs in-process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from loadgen.http import HTTPConnection
from protocol.keys import GROUP, Keys, Lane
from tests.support import Stack, wait_until, write_simulated_model

TOTAL = 2_000


@pytest.fixture(scope="module")
def chaos_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("chaos-models")
    write_simulated_model(repo, "chaos", base_ms=20, per_row_ms=0.1, max_batch=16)
    write_simulated_model(repo, "long", base_ms=900, per_row_ms=0, max_batch=8)
    write_simulated_model(repo, "crashy", base_ms=10, per_row_ms=0.1, max_batch=8)
    config = repo / "crashy" / "config.toml"
    config.write_text(
        config.read_text().replace("[simulated]\n", "[simulated]\ncrash_value = -1\n")
    )
    return repo


class Workers:
    """Real worker processes; all are stopped (SIGKILL if need be) at the end."""

    def __init__(self, redis_url: str, namespace: str, repo: Path) -> None:
        self.redis_url, self.namespace, self.repo = redis_url, namespace, repo
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, model: str, *extra: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferq",
                "worker",
                "--redis",
                self.redis_url,
                "--namespace",
                self.namespace,
                "--model-repository",
                str(self.repo),
                "--models",
                model,
                "--log-level",
                "warning",
                "--heartbeat-s",
                "0.5",
                "--metrics-port",
                "0",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def workers(redis_url, namespace, chaos_repo):
    w = Workers(redis_url, namespace, chaos_repo)
    yield w
    w.stop_all()


@pytest.fixture
def gateway(redis_url, namespace, chaos_repo):
    started: list = []
    s = Stack(redis_url, namespace, chaos_repo, started)
    s.start_gateway()
    yield s
    for thing in reversed(started):
        thing.stop()


def body(i: int, **parameters: object) -> bytes:
    doc: dict = {
        "id": f"req-{i}",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [i] * 4}],
    }
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


@dataclass
class Tally:
    sent: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    """Responses per request id: a request never answered is lost (hung)."""
    wrong: int = 0
    retries: int = 0
    statuses: Counter[int] = field(default_factory=Counter)

    @property
    def answered(self) -> int:
        return sum(1 for n in self.answers.values() if n >= 1)

    def line(self, name: str, **extra: object) -> str:
        duplicates = sum(n - 1 for n in self.answers.values() if n > 1)
        errors = sum(n for s, n in self.statuses.items() if s != 200)
        figures = " ".join(f"{k}={v}" for k, v in extra.items())
        return (
            f"chaos[{name}]: sent={self.sent} answered={self.answered} "
            f"lost={self.sent - self.answered} duplicates={duplicates} errors={errors} "
            f"wrong={self.wrong} {figures}"
        ).strip()


async def load(
    url: str,
    model: str,
    n: int,
    concurrency: int,
    tally: Tally,
    on_progress=None,
    retry_503_s: float = 0.0,
    **parameters: object,
) -> None:
    """Send requests 0..n-1 over ``concurrency`` connections; check every answer's value."""
    host, port = url.removeprefix("http://").split(":")
    next_i = iter(range(n))

    async def lane() -> None:
        async with HTTPConnection(host, int(port), timeout=60) as conn:
            for i in next_i:
                tally.sent += 1
                r = await conn.request(
                    "POST",
                    f"/v2/models/{model}/infer",
                    body(i, **parameters),
                    {"content-type": "application/json"},
                )
                # A well-behaved client retries a 503 (Redis down) for a while, as told.
                give_up = time.monotonic() + retry_503_s
                while r.status == 503 and time.monotonic() < give_up:
                    tally.retries += 1
                    await asyncio.sleep(0.1)
                    r = await conn.request(
                        "POST",
                        f"/v2/models/{model}/infer",
                        body(i, **parameters),
                        {"content-type": "application/json"},
                    )
                tally.statuses[r.status] += 1
                tally.answers[f"req-{i}"] += 1  # any answer, success or error: not lost
                if r.status == 200:
                    doc = r.json()
                    if doc["id"] != f"req-{i}" or doc["outputs"][0]["data"] != [4.0 * i]:
                        tally.wrong += 1
                if on_progress is not None:
                    on_progress(tally)

    await asyncio.gather(*(lane() for _ in range(concurrency)))


def live_workers(s: Stack, model: str) -> int:
    entry = s.gateway.gateway.registry.models.get(model)
    return entry.workers if entry else 0


def test_sigkill_of_a_worker_during_inference_loses_nothing(gateway, workers, capsys):
    procs = [workers.start("chaos", "--claim-idle-ms", "1000") for _ in range(4)]
    wait_until(lambda: live_workers(gateway, "chaos") == 4, timeout_s=30, what="four workers")
    tally = Tally()
    killed_at: list[float] = []

    def kill_once(t: Tally) -> None:
        if not killed_at and t.answered >= TOTAL // 4:
            procs[0].send_signal(signal.SIGKILL)
            killed_at.append(time.monotonic())

    asyncio.run(load(gateway.url, "chaos", TOTAL, 64, tally, on_progress=kill_once))
    recovered_s = time.monotonic() - killed_at[0]
    with capsys.disabled():
        print(
            "\n"
            + tally.line(
                "1 sigkill", killed_after=TOTAL // 4, last_answer_after_kill_s=f"{recovered_s:.1f}"
            )
        )
    assert procs[0].poll() == -signal.SIGKILL
    assert tally.answered == TOTAL and tally.wrong == 0 and tally.statuses[200] == TOTAL


def test_a_restarted_worker_recovers_its_own_pending_entries_at_once(
    gateway, workers, redis_url, capsys
):
    keys = Keys(gateway.namespace)
    first = workers.start("long", "--worker-id", "w-fixed", "--claim-idle-ms", "600000")
    wait_until(lambda: live_workers(gateway, "long") == 1, timeout_s=30, what="the worker")
    tally = Tally()

    async def scenario() -> None:
        task = asyncio.create_task(load(gateway.url, "long", 8, 8, tally))
        stream = keys.stream("long", Lane.NORMAL)
        with redis.Redis.from_url(redis_url) as r:
            await asyncio.to_thread(
                wait_until, lambda: r.xpending(stream, GROUP)["pending"] == 8, 30, "8 pending"
            )
        first.send_signal(signal.SIGKILL)
        first.wait()
        started = time.monotonic()
        workers.start("long", "--worker-id", "w-fixed", "--claim-idle-ms", "600000")
        await task
        with capsys.disabled():
            print(
                "\n"
                + tally.line(
                    "2 same-name restart", recovered_in_s=f"{time.monotonic() - started:.1f}"
                )
            )

    asyncio.run(scenario())
    # Recovered from its own pending list (claim_idle is ten minutes: no reclaim happened).
    assert tally.answered == 8 and tally.wrong == 0


def test_a_stopped_then_resumed_worker_causes_no_duplicate_replies(gateway, workers, capsys):
    procs = [workers.start("chaos", "--claim-idle-ms", "500") for _ in range(2)]
    wait_until(lambda: live_workers(gateway, "chaos") == 2, timeout_s=30, what="two workers")
    tally = Tally()
    stopped: list[int] = []

    def stop_once(t: Tally) -> None:
        if not stopped and t.answered >= 100:
            procs[0].send_signal(signal.SIGSTOP)
            stopped.append(1)

    async def scenario() -> None:
        task = asyncio.create_task(
            load(gateway.url, "chaos", 600, 32, tally, on_progress=stop_once)
        )
        await asyncio.to_thread(wait_until, lambda: bool(stopped), 30, "the stop")
        await asyncio.sleep(1.5)  # hold it stopped past its 500 ms lease
        procs[0].send_signal(signal.SIGCONT)
        await task

    asyncio.run(scenario())
    with capsys.disabled():
        print("\n" + tally.line("3 sigstop past lease"))
    assert tally.answered == 600 and tally.wrong == 0
    assert max(tally.answers.values()) == 1


def test_requests_whose_deadline_passed_before_workers_came_back_never_run(
    gateway, workers, redis_url, capsys
):
    keys = Keys(gateway.namespace)
    first = workers.start("chaos")
    wait_until(lambda: live_workers(gateway, "chaos") == 1, timeout_s=30, what="the worker")
    first.send_signal(signal.SIGTERM)
    first.wait(30)
    tally = Tally()
    asyncio.run(load(gateway.url, "chaos", 50, 50, tally, timeout=1_000_000))  # 1 s deadlines
    assert tally.statuses[504] == 50
    time.sleep(2)  # the scenario: workers come back 3 s after the requests were sent
    workers.start("chaos")
    stream = keys.stream("chaos", Lane.NORMAL)
    with redis.Redis.from_url(redis_url) as r:
        wait_until(
            lambda: (
                r.xinfo_groups(stream)[0]["lag"] == 0 and r.xpending(stream, GROUP)["pending"] == 0
            ),
            30,
            "all 50 read and acked",
        )
        executed = sum(1 for k in r.scan_iter(match=f"{gateway.namespace}:result:*"))
    with capsys.disabled():
        print("\n" + tally.line("6 deadline before restart", executed=executed))
    assert executed == 0


def test_sigterm_scale_in_under_load_fails_nothing_and_leaves_no_pending(
    gateway, workers, redis_url, capsys
):
    keys = Keys(gateway.namespace)
    procs = [workers.start("chaos") for _ in range(3)]
    wait_until(lambda: live_workers(gateway, "chaos") == 3, timeout_s=30, what="three workers")
    tally = Tally()
    terminated: list[int] = []

    def scale_in(t: Tally) -> None:
        if not terminated and t.answered >= 300:
            procs[0].send_signal(signal.SIGTERM)
            terminated.append(1)

    asyncio.run(load(gateway.url, "chaos", 1_200, 48, tally, on_progress=scale_in))
    assert procs[0].wait(30) == 0
    with redis.Redis.from_url(redis_url) as r:
        leftovers = {
            c["name"].decode(): c["pending"]
            for lane in Lane
            for c in r.xinfo_consumers(keys.stream("chaos", lane), GROUP)
        }
    with capsys.disabled():
        print("\n" + tally.line("11 sigterm scale-in", exit_code=procs[0].returncode))
    assert tally.answered == 1_200 and tally.statuses[200] == 1_200
    assert all(p == 0 for p in leftovers.values()), leftovers


def test_a_request_that_crashes_every_worker_is_dead_lettered_and_the_rest_answered(
    gateway, workers, redis_url, capsys
):
    keys = Keys(gateway.namespace)
    procs = [
        workers.start("crashy", "--claim-idle-ms", "500", "--max-deliveries", "3") for _ in range(4)
    ]
    wait_until(lambda: live_workers(gateway, "crashy") == 4, timeout_s=30, what="four workers")
    tally = Tally()

    async def scenario() -> tuple[int, str]:
        host, port = gateway.url.removeprefix("http://").split(":")
        async with HTTPConnection(host, int(port), timeout=60) as conn:
            poison = asyncio.create_task(
                conn.request(
                    "POST",
                    "/v2/models/crashy/infer",
                    body(-1),
                    {"content-type": "application/json"},
                )
            )
            await load(gateway.url, "crashy", 300, 16, tally)
            r = await poison
            return r.status, r.json()["error"]

    status, error = asyncio.run(scenario())
    crashed = sum(1 for p in procs if p.poll() == 70)
    with redis.Redis.from_url(redis_url) as r:
        dead = r.xlen(keys.dlq("crashy"))
    with capsys.disabled():
        print(
            "\n"
            + tally.line(
                "5 poison crash", workers_crashed=crashed, dead_letters=dead, poison_status=status
            )
        )
    assert status == 500 and "dead-letter" in error
    assert dead == 1 and 1 <= crashed <= 3
    assert tally.answered == 300 and tally.statuses[200] == 300 and tally.wrong == 0


def test_redis_killed_and_restarted_under_load_hangs_nothing(
    workers, namespace, chaos_repo, tmp_path, capsys
):
    """redis-server SIGKILLed mid-load with AOF (fsync every second), restarted on its data."""
    from inferq.redisserver import RedisServer

    server = RedisServer(
        data_dir=tmp_path, extra_args=("--appendonly", "yes", "--appendfsync", "everysec")
    )
    server.start()
    started: list = []
    try:
        workers.redis_url = server.url
        for _ in range(2):
            workers.start("chaos", "--claim-idle-ms", "1000")
        s = Stack(server.url, namespace, chaos_repo, started)
        s.start_gateway()
        wait_until(lambda: live_workers(s, "chaos") == 2, timeout_s=30, what="two workers")
        tally = Tally()
        events: dict[str, float] = {}

        def crash_once(t: Tally) -> None:
            if "killed" not in events and t.answered >= 300:
                server.kill()
                events["killed"] = time.monotonic()

        async def scenario() -> None:
            task = asyncio.create_task(
                load(
                    s.url,
                    "chaos",
                    1_500,
                    32,
                    tally,
                    on_progress=crash_once,
                    retry_503_s=10.0,
                    timeout=5_000_000,
                )
            )
            await asyncio.to_thread(wait_until, lambda: "killed" in events, 60, "the crash")
            await asyncio.sleep(1.0)  # Redis stays down for a second
            await asyncio.to_thread(server.start)
            events["restarted"] = time.monotonic()
            ok_before = tally.statuses[200]
            await asyncio.to_thread(
                wait_until,
                lambda: tally.statuses[200] > ok_before,
                30,
                "a success after the restart",
            )
            events["served"] = time.monotonic()
            await task

        asyncio.run(scenario())
        served_after = events["served"] - events["restarted"]
        with capsys.disabled():
            print(
                "\n"
                + tally.line(
                    "8 redis killed",
                    ok=tally.statuses[200],
                    retried_503s=tally.retries,
                    unavailable_503=tally.statuses[503],
                    deadline_504=tally.statuses[504],
                    served_again_after_s=f"{served_after:.1f}",
                    lost_acknowledged_enqueues_at_most=tally.statuses[504],
                )
            )
        assert tally.answered == tally.sent == 1_500  # hung = 0
        assert set(tally.statuses) <= {200, 503, 504} and tally.wrong == 0
        assert served_after <= 5.0
    finally:
        for thing in reversed(started):
            thing.stop()
        workers.stop_all()
        server.stop()


def test_ten_thousand_waiting_requests_keep_redis_connections_flat(
    workers, redis_url, namespace, chaos_repo, capsys
):
    """10,000 requests wait at once on a 3 s model; Redis sees the same few connections."""
    from inferq.redisserver import free_port

    config = chaos_repo / "hold" / "config.toml"
    if not config.exists():
        write_simulated_model(chaos_repo, "hold", base_ms=3000, per_row_ms=0, max_batch=20_000)
    port = free_port()
    gateway = _gateway_process(redis_url, namespace, port, "--max-timeout-ms", "120000")
    try:
        workers.start("hold")
        with redis.Redis.from_url(redis_url) as r:

            def ours() -> int:
                return sum(
                    1
                    for c in r.client_list()
                    if c["name"].startswith(("inferq-gateway", "inferq-worker"))
                )

            wait_until(lambda: _ready(port), 30, "the gateway to be ready")
            before = ours()
            n = 10_000
            peak = 0

            async def flood() -> list[int]:
                nonlocal peak
                conns = [HTTPConnection("127.0.0.1", port, timeout=120) for _ in range(n)]
                for i in range(0, n, 500):
                    await asyncio.gather(*(c.connect() for c in conns[i : i + 500]))
                tasks = [
                    asyncio.create_task(
                        c.request(
                            "POST",
                            "/v2/models/hold/infer",
                            body(i, timeout=60_000_000),
                            {"content-type": "application/json"},
                        )
                    )
                    for i, c in enumerate(conns)
                ]
                while not all(t.done() for t in tasks):
                    peak = max(peak, await asyncio.to_thread(ours))
                    await asyncio.sleep(0.1)
                statuses = [t.result().status for t in tasks]
                await asyncio.gather(*(c.aclose() for c in conns))
                return statuses

            statuses = asyncio.run(flood())
            clients = int(r.info("clients")["connected_clients"])
        with capsys.disabled():
            print(
                f"\nchaos[10 10k waiters]: sent={n} ok={statuses.count(200)} "
                f"inferq_connections_idle={before} inferq_connections_peak={peak} "
                f"redis_connected_clients_after={clients}"
            )
        assert statuses.count(200) == n
        assert peak <= before + 8  # one gateway, one worker: bounded pools, whatever the load
    finally:
        gateway.terminate()
        gateway.wait(30)


def _gateway_process(
    redis_url: str, namespace: str, port: int, *extra: str
) -> subprocess.Popen[bytes]:
    """A real gateway process, for scenarios that measure it or need its own file descriptors."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferq",
            "gateway",
            "--redis",
            redis_url,
            "--namespace",
            namespace,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _ready(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_three_times_overload_gets_successes_in_time_or_fast_refusals(
    workers, redis_url, namespace, chaos_repo, capsys
):
    """20 s of open-loop load at 3x what one worker can serve, 500 ms deadlines: every answer is
    a success within its deadline or a fast 429/503; the gateway's memory stays bounded."""
    from inferq.redisserver import free_port

    if not (chaos_repo / "overload").exists():
        write_simulated_model(chaos_repo, "overload", base_ms=50, per_row_ms=1, max_batch=8)
    port = free_port()
    gateway = _gateway_process(redis_url, namespace, port)
    try:
        workers.start("overload")
        wait_until(lambda: _ready(port), 30, "the gateway to be ready")
        capacity = 8 / 0.058  # rows per batch / batch time
        rate, seconds, deadline_s = 3 * capacity, 20.0, 0.5
        results: list[tuple[int, float]] = []
        rss_start = _rss_mb(gateway.pid)

        async def open_loop() -> None:
            pool: asyncio.Queue[HTTPConnection] = asyncio.Queue()
            for _ in range(300):
                pool.put_nowait(HTTPConnection("127.0.0.1", port, timeout=10))

            async def one(i: int) -> None:
                conn = await pool.get()
                sent = time.monotonic()
                try:
                    r = await conn.request(
                        "POST",
                        "/v2/models/overload/infer",
                        body(i, timeout=int(deadline_s * 1e6)),
                        {"content-type": "application/json"},
                    )
                    results.append((r.status, time.monotonic() - sent))
                finally:
                    pool.put_nowait(conn)

            start = time.monotonic()
            tasks = []
            for i in range(int(rate * seconds)):  # bounded in count, paced in time
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
            while not pool.empty():
                await pool.get_nowait().aclose()

        asyncio.run(open_loop())
        rss_end = _rss_mb(gateway.pid)
        by_status = Counter(s for s, _ in results)
        slow_ok = sum(1 for s, t in results if s == 200 and t > deadline_s + 0.1)
        # "Fast": well inside the deadline the client would otherwise have waited out.
        slow_refusals = sum(1 for s, t in results if s in (429, 503) and t > deadline_s / 2)
        with capsys.disabled():
            print(
                f"\nchaos[12 3x overload]: sent={len(results)} ok={by_status[200]} "
                f"refused_429={by_status[429]} unavailable_503={by_status[503]} "
                f"deadline_504={by_status[504]} ok_over_deadline={slow_ok} "
                f"slow_refusals={slow_refusals} gateway_rss_mb={rss_start:.0f}->{rss_end:.0f}"
            )
        assert set(by_status) <= {200, 429, 503, 504}
        assert by_status[200] > 0 and by_status[429] > 0
        assert by_status[504] <= len(results) * 0.02  # the wait is an estimate
        assert slow_refusals <= len(results) * 0.01
        assert rss_end - rss_start < 100
    finally:
        gateway.terminate()
        gateway.wait(30)


def test_a_rolling_restart_of_every_worker_under_load_loses_nothing(
    gateway, workers, redis_url, capsys
):
    keys = Keys(gateway.namespace)
    procs = [workers.start("chaos") for _ in range(2)]
    wait_until(lambda: live_workers(gateway, "chaos") == 2, timeout_s=30, what="two workers")
    tally = Tally()
    restarted: list[int] = []

    async def scenario() -> None:
        task = asyncio.create_task(load(gateway.url, "chaos", 3_000, 32, tally))
        for old in list(procs):  # one at a time: start the replacement, then drain the old one
            await asyncio.to_thread(
                wait_until, lambda: tally.answered >= 500 * (len(restarted) + 1), 60, "load"
            )
            workers.start("chaos")
            # As a rollout does: the replacement is live (advertised) before the old one drains.
            await asyncio.to_thread(
                wait_until, lambda: live_workers(gateway, "chaos") == 3, 30, "the replacement"
            )
            old.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(old.wait, 30) == 0
            restarted.append(old.pid)
        await task

    asyncio.run(scenario())
    with redis.Redis.from_url(redis_url) as r:
        stream = keys.stream("chaos", Lane.NORMAL)
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, 30, "nothing pending")
    with capsys.disabled():
        print("\n" + tally.line("rolling restart", workers_replaced=len(restarted)))
    assert tally.answered == 3_000 and tally.statuses[200] == 3_000, tally.statuses
    assert tally.wrong == 0
