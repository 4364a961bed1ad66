"""Python models through real HTTP, Redis, gateways and workers: batched like any model, BYTES
both ways, a wrong output or a raising row answered without harm to the rest, a call that hangs
past its deadline while the worker serves on, a hot swap under load, a crash restarted by the
supervisor, and the two examples answering as they do in-process."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from consumer.backends import create_backend
from consumer.repository import load_config
from protocol.keys import Keys
from tests.consumer.test_python_backend import (
    ECHO,
    HANGS_UNTIL_RELEASED,
    TEXT_IO,
    write_model,
)
from tests.integration.test_model_control import TOKEN, BackgroundAdmin
from tests.support import GatewayThread, Stack, WorkerThread, wait_until
from tests.upstack import up_processes

SAMPLES = json.loads(
    (Path(__file__).resolve().parents[2] / "models/digits/samples.json").read_text()
)["inputs"]

BATCH_IO = TEXT_IO.replace('name = "length"', 'name = "rows_in_call"')
"""``text`` in; ``upper`` and, for each row, the number of rows in its model call, out."""

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
        queued = slot.model.max_batch - len(texts)  # rows the slot still wants
        wait_until(lambda: slot.wanted_count() == queued, what="the batch queued")
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
    # They were queued as one batch, which was split until the row was found.
    ok = [r.json()["outputs"][1]["data"] for i, r in enumerate(replies) if i != 5]
    assert all(rows < 8 for (rows,) in ok)


@pytest.mark.serial  # bounds the refusal time
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


@pytest.mark.serial  # counts requests sent after the swap
def test_a_hot_swap_of_a_python_model_under_load_fails_no_request(python_stack):
    s = python_stack
    s.add_worker(retire_after_s=1.0)
    with s.client() as c:
        wait_until(
            lambda: c.get("/v2/models/swap").json()["parameters"]["workers"] == 2,
            what="both workers serving swap",
        )
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
    by = Counter((o[1], o[2]) for o in outcomes)
    assert Counter(o[1] for o in outcomes) == {200: 800}, by
    # Each answer came from the version it names (model.py returns its own version).
    assert all(o[3] == [int(o[2])] for o in outcomes)
    assert {o[2] for o in outcomes if o[0] < swap.started_at} == {"1"}, by
    assert {o[2] for o in outcomes if o[0] > swap.ended_at} == {"2"}, by
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


# -- the guide's blocks (docs/python-backend.md), run as written ---------------------------------

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "python-backend.md"


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the Python backend's guide."""
    return re.findall(r"```(\w+)\n(.*?)```", GUIDE.read_text(), re.S)


def block(language: str, containing: str) -> str:
    (found,) = [t for lang, t in readme_blocks() if lang == language and containing in t]
    return found


def expected_output(snippet: str) -> str:
    """What the guide says a snippet prints: its trailing ``# `` comment lines."""
    lines = snippet.rstrip("\n").splitlines()
    out: list[str] = []
    while lines and lines[-1].startswith("# "):
        out.insert(0, lines.pop()[2:])
    return "\n".join(out)


@pytest.fixture(scope="module")
def examples_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guide's minimal model, and the two examples as `inferq models build-examples`
    leaves them."""
    from inferq import examples

    repo = tmp_path_factory.mktemp("examples") / "models"
    for name in ("digits-png", "topics"):
        shutil.copytree(
            ROOT / "models" / name,
            repo / name,
            ignore=shutil.ignore_patterns("*.onnx", "tokenizer.json", "__pycache__"),
        )
    shutil.copy(ROOT / "models" / "digits-png" / "1" / "model.onnx", repo / "digits-png" / "1")
    assert {p.name for p in examples.build(repo, ("topics",))} == {"model.onnx", "tokenizer.json"}
    for path in ("models/reverse/config.toml", "models/reverse/1/model.py"):
        language = "toml" if path.endswith(".toml") else "python"
        target = repo.parent / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block(language, f"# {path}\n"))
    return repo


@pytest.fixture(scope="module")
def examples_stack(redis_server, examples_repo: Path) -> Iterator[Stack]:
    started: list[GatewayThread | WorkerThread] = []
    s = Stack(redis_server.url, f"examples-{uuid.uuid4().hex[:8]}", examples_repo, started)
    try:
        s.add_worker()
        s.start_gateway()
        yield s
    finally:
        for thing in reversed(started):
            thing.stop()


def run_curl(s: Stack, snippet: str) -> dict[str, Any]:
    """The snippet's curl command, run by bash from the repository root against ``s``."""
    command = "\n".join(
        line for line in snippet.splitlines() if not line.startswith(("#", "inferq models"))
    ).replace("http://127.0.0.1:8000", s.url)
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def run_snippet(s: Stack, snippet: str) -> tuple[str, dict[str, list[Any]]]:
    """The snippet run by Python from the repository root against ``s``: what it printed, and
    every output of its ``result``, flattened."""
    dump = (
        "\nimport json as _json, sys as _sys\n"
        "_sys.stderr.write(_json.dumps({o['name']: [x.decode() if isinstance(x, bytes) else x "
        "for x in result.as_numpy(o['name']).reshape(-1).tolist()] "
        "for o in result.get_response()['outputs']}))\n"
    )
    code = snippet.replace("127.0.0.1:8000", s.url.removeprefix("http://")) + dump
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.rstrip("\n"), json.loads(done.stderr)


def in_process(repo: Path, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    backend = create_backend(load_config(repo, model), "1")
    backend.load()
    try:
        return backend.predict(inputs)
    finally:
        backend.unload()


def outputs_of(answer: dict[str, Any]) -> dict[str, Any]:
    return {o["name"]: o["data"] for o in answer["outputs"]}


def test_the_readmes_minimal_model_answers_as_the_readme_says(examples_stack):
    snippet = block("sh", "/v2/models/reverse/infer")
    assert run_curl(examples_stack, snippet) == json.loads(expected_output(snippet))


def test_the_readmes_digits_png_lines_answer_as_the_same_code_in_process(
    examples_stack, examples_repo
):
    png = (ROOT / "models" / "digits-png" / "1" / "samples" / "3.png").read_bytes()
    expected = in_process(examples_repo, "digits-png", {"image": np.array([png], dtype=object)})
    digits = in_process(ROOT / "models", "digits", {"input": np.array([SAMPLES[3]], np.float32)})
    assert expected["label"].tolist() == [3] == digits["label"].tolist()

    snippet = block("sh", "/v2/models/digits-png/infer")
    answer = outputs_of(run_curl(examples_stack, snippet))
    assert answer == outputs_of(json.loads(expected_output(snippet)))  # the guide's own line
    assert answer["label"] == expected["label"].tolist()
    assert np.array_equal(
        np.array(answer["probabilities"], np.float32), expected["probabilities"].reshape(-1)
    )

    snippet = block("python", '"digits-png"')
    printed, result = run_snippet(examples_stack, snippet)
    assert printed == expected_output(snippet)
    assert result["label"] == [3]
    assert np.array_equal(
        np.array(result["probabilities"], np.float32), expected["probabilities"].reshape(-1)
    )


def test_the_readmes_topics_lines_answer_as_the_same_code_in_process(examples_stack, examples_repo):
    snippet = block("sh", "/v2/models/topics/infer")
    answer = outputs_of(run_curl(examples_stack, snippet))
    said = outputs_of(json.loads(expected_output(snippet)))
    texts = json.loads(re.search(r"-d '(.*)'", snippet).group(1))["inputs"][0]["data"]
    expected = in_process(
        examples_repo, "topics", {"text": np.array([t.encode() for t in texts], dtype=object)}
    )
    assert (
        answer["labels"] == said["labels"] == [b.decode() for b in expected["labels"].reshape(-1)]
    )
    assert np.allclose(answer["scores"], said["scores"], atol=1e-5)
    assert np.allclose(answer["scores"], expected["scores"].reshape(-1), atol=1e-6)

    snippet = block("python", '"topics"')
    printed, result = run_snippet(examples_stack, snippet)
    assert printed == expected_output(snippet)
    sent = [b"Snow and strong winds tonight.", b"Bake it for an hour."]
    expected = in_process(examples_repo, "topics", {"text": np.array(sent, dtype=object)})
    assert result["labels"] == [b.decode() for b in expected["labels"].reshape(-1)]
    assert np.allclose(result["scores"], expected["scores"].reshape(-1), atol=1e-6)
