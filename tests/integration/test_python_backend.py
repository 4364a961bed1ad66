"""Python models through real HTTP, Redis, gateways and workers: batched like any model, BYTES
both ways, a wrong output or a raising row answered without harm to the rest, a call that hangs
past its deadline while the worker serves on, a hot swap under load, a crash restarted by the
supervisor, and the two examples answering as they do in-process."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from protocol.keys import Keys
from tests.consumer.test_python_backend import ECHO, HANGS_UNTIL_RELEASED, write_model
from tests.integration.test_model_control import TOKEN, BackgroundAdmin
from tests.support import GatewayThread, Stack, WorkerThread, wait_until
from tests.upstack import up_processes

BATCH_IO = """
[[inputs]]
name = "text"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "upper"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "rows_in_call"
datatype = "INT64"
shape = [-1]
"""

BATCHES = """
import time
import numpy as np

class Batches:
    def load(self, config, device):
        self.folder = config.folder

    def predict(self, inputs):
        text = inputs["text"].tolist()
        if b"hold" in text:  # keeps the model busy while the test queues a batch behind it
            (self.folder / "holding").touch()
            limit = time.monotonic() + 30
            while not (self.folder / "release").exists() and time.monotonic() < limit:
                time.sleep(0.005)
        if b"poison" in text:
            raise ValueError("poison in the batch")
        return {
            "upper": np.array([t.upper() for t in text], dtype=object),
            "rows_in_call": np.full(len(text), len(text), np.int64),
        }
"""

WRONG_SHAPE = """
import numpy as np

class WrongShape:
    def predict(self, inputs):
        n = len(inputs["text"])
        return {"upper": inputs["text"], "length": np.zeros((n, 2), np.int64)}
"""

VERSIONED = """
import numpy as np

class Versioned:
    def load(self, config, device):
        self.version = int(config.version)

    def predict(self, inputs):
        n = len(inputs["text"])
        return {"upper": inputs["text"], "length": np.full(n, self.version, np.int64)}
"""

CRASHES = """
import os
import numpy as np

class Crashes:
    def predict(self, inputs):
        if b"crash" in inputs["text"].tolist():
            os._exit(70)  # as a segfault in a native library would end the process
        return {"upper": inputs["text"], "length": np.zeros(len(inputs["text"]), np.int64)}
"""


def body(*texts: str, **parameters: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]
    }
    if parameters:
        out["parameters"] = parameters
    return out


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "echo", ECHO)
    write_model(repo, "batched", BATCHES, io=BATCH_IO)
    write_model(repo, "wrong", WRONG_SHAPE)
    write_model(repo, "hang", HANGS_UNTIL_RELEASED, timeout_ms=1000)
    write_model(
        repo, "swap", VERSIONED, versions=("1", "2"), extra='[version_policy]\nspecific = ["1"]\n'
    )
    return repo


@pytest.fixture
def python_stack(redis_url: str, namespace: str, repo: Path) -> Iterator[Stack]:
    started: list[GatewayThread | WorkerThread] = []
    s = Stack(redis_url, namespace, repo, started)
    try:
        s.add_worker(retire_after_s=1.0)
        s.start_gateway(admin_token=TOKEN)
        yield s
    finally:
        for thing in reversed(started):
            thing.stop()


def one_batch(s: Stack, texts: list[str]) -> list[httpx.Response]:
    """One request per text to ``batched``, all queued while the model is busy with an earlier
    call, so that they run as one batch when it ends; the answers, in order."""
    folder = s.repo / "batched" / "1"
    slot = s.workers[0].worker.slots["batched"]

    def send(text: str) -> httpx.Response:
        with s.client() as c:
            return c.post("/v2/models/batched/infer", json=body(text))

    with ThreadPoolExecutor(len(texts) + 1) as pool:
        hold = pool.submit(send, "hold")
        wait_until(lambda: (folder / "holding").exists(), what="the model to be busy")
        replies = [pool.submit(send, t) for t in texts]
        wait_until(lambda: len(slot.queue) == len(texts), what="the batch queued")
        (folder / "release").touch()
        assert hold.result().status_code == 200
        return [r.result() for r in replies]


def test_requests_queued_together_run_as_one_call_of_the_model(python_stack):
    replies = one_batch(python_stack, ["a", "b", "c", "d"])
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    outputs = [{o["name"]: o["data"] for o in r.json()["outputs"]} for r in replies]
    assert [o["upper"] for o in outputs] == [["A"], ["B"], ["C"], ["D"]]
    assert [o["rows_in_call"] for o in outputs] == [[4]] * 4  # one call held all four rows


def test_bytes_go_in_and_out_as_json_and_as_binary_data(python_stack):
    r = python_stack.infer("echo", body("héllo", "", "x y"))
    assert r.status_code == 200, r.text
    upper, length = r.json()["outputs"]
    assert upper == {
        "name": "upper",
        "datatype": "BYTES",
        "shape": [3],
        "data": ["HéLLO", "", "X Y"],
    }
    assert length["data"] == [6, 0, 3]  # bytes, not characters

    import tritonclient.http as triton

    client = triton.InferenceServerClient(python_stack.url.removeprefix("http://"))
    text = triton.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"\x00\xffraw", b"abc"], dtype=object))
    result = client.infer("echo", [text])
    assert result.as_numpy("upper").tolist() == [b"\x00\xffRAW", b"ABC"]
    assert result.as_numpy("length").tolist() == [5, 3]
    client.close()


def test_an_output_of_the_wrong_shape_is_a_500_naming_the_model_and_the_output(python_stack):
    r = python_stack.infer("wrong", body("a", "b"))
    assert r.status_code == 500
    assert r.json()["error"] == (
        "model 'wrong' version 1 returned shape [2, 2] for output 'length'; config.toml "
        "declares [-1]"
    )
    assert python_stack.infer("echo", body("still serving")).status_code == 200
    assert all(w.running for w in python_stack.workers)


def test_an_exception_on_one_row_fails_only_the_request_that_holds_it(python_stack):
    texts = ["ok"] * 5 + ["poison"] + ["ok"] * 2
    replies = one_batch(python_stack, texts)
    assert [r.status_code for r in replies] == [200] * 5 + [500] + [200] * 2
    line = BATCHES.splitlines().index('            raise ValueError("poison in the batch")') + 1
    assert replies[5].json()["error"] == (
        f"model 'batched' failed: predict raised ValueError: poison in the batch (model.py line "
        f"{line})"
    )
    # They ran as one batch, which was split until the row was found.
    assert python_stack.workers[0].worker.slots["batched"].model.bisections >= 1
    ok = [r.json()["outputs"][1]["data"] for i, r in enumerate(replies) if i != 5]
    assert all(rows < 8 for (rows,) in ok)


def test_a_call_that_hangs_past_its_deadline_leaves_the_worker_serving(
    python_stack, redis_url, namespace, repo
):
    s = python_stack
    worker = s.workers[0].worker
    keys = Keys(namespace)
    hung: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: hung.append(s.infer("hang", body("hang"))))
    sender.start()
    try:
        wait_until(lambda: worker.stats.batches >= 1 or bool(hung), what="the hanging call")
        # While the call hangs: other models are served, and the heartbeat goes on.
        with redis.Redis.from_url(redis_url) as r:
            beat = r.zscore(keys.workers, worker.id)
            for i in range(3):
                assert s.infer("echo", body(f"during {i}")).status_code == 200
            wait_until(lambda: r.zscore(keys.workers, worker.id) > beat, what="a heartbeat")
        sender.join(10)
        assert hung[0].status_code == 504, hung[0].text  # the gateway's deadline, 1 s
        # The worker gave up on the call at the same deadline; the call still holds its thread,
        # so the model's next batches fail at once instead of queueing behind it.
        started = time.monotonic()
        refused = s.infer("hang", body("ok"))
        assert refused.status_code == 500 and time.monotonic() - started < 0.9
        assert "not run: predict overran its deadline" in refused.json()["error"]
        assert s.infer("echo", body("after")).status_code == 200
    finally:
        (repo / "hang" / "1" / "release").touch()
        sender.join(10)
    # Once the call returns, the model serves again, on the same worker.
    wait_until(lambda: s.infer("hang", body("ok")).status_code == 200, what="hang serving again")
    assert all(w.running for w in s.workers)


def test_a_hot_swap_of_a_python_model_under_load_fails_no_request(python_stack):
    s = python_stack
    s.add_worker(retire_after_s=1.0)
    s.wait_ready("swap")
    half = threading.Event()
    swap = BackgroundAdmin(
        s, "/v2/repository/models/swap/load", {"parameters": {"version": "2"}}, half
    )
    swap.start()
    outcomes: list[tuple[float, int, str | None, list[int] | None]] = []
    lock = threading.Lock()
    counter = iter(range(800))

    def client_loop() -> None:
        with s.client(headers={"cache-control": "no-cache"}) as c:
            while (i := next(counter, None)) is not None:
                sent = time.monotonic()
                r = c.post("/v2/models/swap/infer", json=body(f"r{i}"))
                ok = r.status_code == 200
                version = r.json()["model_version"] if ok else None
                length = r.json()["outputs"][1]["data"] if ok else None
                with lock:
                    outcomes.append((sent, r.status_code, version, length))
                    if len(outcomes) == 250:
                        half.set()

    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(client_loop) for _ in range(8)]:
            f.result()
    status, answer = swap.result()
    assert status == 200, answer
    assert answer["versions"] == ["2"] and len(answer["workers"]) == 2
    assert Counter(o[1] for o in outcomes) == {200: 800}
    # Each answer came from the version it names (model.py returns its own version).
    assert all(o[3] == [int(o[2])] for o in outcomes)
    assert {o[2] for o in outcomes if o[0] < swap.started_at} == {"1"}
    assert {o[2] for o in outcomes if o[0] > swap.ended_at} == {"2"}
    wait_until(
        lambda: all(
            list(w.worker.slots["swap"].model.backends) == ["2"]
            and not w.worker.slots["swap"].model.retiring
            for w in s.workers
        ),
        what="version 1 unloaded on every worker",
    )


@pytest.mark.timeout(180)
def test_a_python_model_that_crashes_its_worker_is_restarted_and_serves_again(
    redis_url, namespace, tmp_path
):
    repo = tmp_path / "repo"
    write_model(repo, "crashy", CRASHES, timeout_ms=60_000)
    with up_processes(redis_url, namespace, repo) as start:
        u = start()
        u.wait_ready()
        with httpx.Client(base_url=u.url, timeout=60) as c:
            # The poison crashes the worker each time it runs, until its deadline (2 s) passes
            # and the restarted worker drops it unrun.
            poison = c.post("/v2/models/crashy/infer", json=body("crash", timeout=2_000_000))
            assert poison.status_code == 504, poison.text
            u.wait_for(lambda: u.events("child restarted", child="worker 0") != [], "a restart")
            r = c.post("/v2/models/crashy/infer", json=body("fine"))
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["data"] == ["fine"]
        exits = u.events("child exited", child="worker 0")
        assert exits and all(e["exit"] == "exit code 70" for e in exits)
        assert u.stop() == 0
