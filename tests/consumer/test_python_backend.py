"""The Python backend: a version's model.py serves batches like any backend, its outputs are
checked against the config, a row that raises fails alone, a call past its deadline leaves the
worker serving, and only code inside the repository runs."""

from __future__ import annotations

import re
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from consumer.backends import BackendError, create_backend
from consumer.backends.python import PythonBackend
from consumer.model import ServedModel
from consumer.repository import RepositoryError, load_config
from protocol.messages import InferRequest, Status
from protocol.tensor import Tensor

TEXT_IO = """
[[inputs]]
name = "text"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "upper"
datatype = "BYTES"
shape = [-1]

[[outputs]]
name = "length"
datatype = "INT64"
shape = [-1]
"""

ECHO = """
import numpy as np

class Echo:
    def load(self, config, device):
        self.calls = []

    def predict(self, inputs):
        text = inputs["text"]
        self.calls.append(len(text))
        return {
            "upper": np.array([t.upper() for t in text], dtype=object),
            "length": np.array([len(t) for t in text], dtype=np.int64),
        }
"""


def write_model(
    repo: Path,
    name: str,
    code: str,
    *,
    io: str = TEXT_IO,
    extra: str = "",
    versions: tuple[str, ...] = ("1",),
    warmup: bool = False,
    max_batch: int = 8,
    flush_ms: float = 2.0,
    timeout_ms: int = 5000,
) -> Path:
    """A python model ``name`` whose every version runs ``code`` as its model.py (no warm-up
    unless ``warmup``)."""
    folder = repo / name
    for v in versions:
        (folder / v).mkdir(parents=True, exist_ok=True)
        (folder / v / "model.py").write_text(textwrap.dedent(code))
    sizes = "" if warmup else "[warmup]\nbatch_sizes = []\n"
    (folder / "config.toml").write_text(
        f'backend = "python"\nmax_batch = {max_batch}\nflush_ms = {flush_ms}\n'
        f"default_timeout_ms = {timeout_ms}\n{extra}\n{sizes}{io}"
    )
    return folder


def text_request(i: int, *texts: bytes, model: str = "m") -> InferRequest:
    column = np.empty(len(texts), dtype=object)
    column[:] = list(texts)
    return InferRequest(
        id=f"r{i}",
        model=model,
        version="1",
        inputs=[Tensor.from_numpy("text", column, "BYTES")],
        outputs=None,
        deadline_ms=10**15,
        enqueued_ms=0,
        result_key="",
        result_ttl_ms=1,
    )


def served(repo: Path, name: str = "m") -> ServedModel:
    model = ServedModel(load_config(repo, name))
    model.load()
    return model


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return tmp_path / "repo"


def test_rows_of_several_requests_run_as_one_call_and_bytes_go_both_ways(repo):
    write_model(repo, "m", ECHO)
    model = served(repo)
    try:
        outcome = model.run(
            [text_request(0, b"ab"), text_request(1, b"cde", b"f"), text_request(2, b"")], "w"
        )
        assert [r.status for r in outcome.results] == [Status.OK] * 3
        upper = [r.outputs[0].to_numpy().tolist() for r in outcome.results]
        length = [r.outputs[1].to_numpy().tolist() for r in outcome.results]
        assert upper == [[b"AB"], [b"CDE", b"F"], [b""]]
        assert length == [[2], [3, 1], [0]]
        assert model.backends["1"].model.calls == [4]
    finally:
        model.unload()


def test_the_model_runs_on_its_own_thread_never_inline(repo):
    write_model(
        repo,
        "m",
        """
        import threading
        import numpy as np

        class Where:
            def __init__(self):
                self.threads = {threading.current_thread().name}

            def load(self, config, device):
                self.threads.add(threading.current_thread().name)

            def predict(self, inputs):
                self.threads.add(threading.current_thread().name)
                n = len(inputs["text"])
                return {"upper": inputs["text"], "length": np.zeros(n, np.int64)}
        """,
    )
    model = served(repo)
    backend = model.backends["1"]
    model.run([text_request(0, b"x")], "w")
    assert backend.model.threads == {"python-m-1"}
    assert threading.current_thread().name != "python-m-1"
    assert not model.may_run_inline("1") and not backend.may_run_inline
    model.unload()


def test_load_gets_the_config_and_the_device(repo):
    write_model(
        repo,
        "m",
        """
        import numpy as np

        class Configured:
            def load(self, config, device):
                self.seen = (config, device)

            def predict(self, inputs):
                n = len(inputs["text"])
                return {"upper": inputs["text"], "length": np.zeros(n, np.int64)}
        """,
        extra='[python.parameters]\nthreshold = 0.5\nlabels = ["a", "b"]\n',
    )
    backend = create_backend(load_config(repo, "m"), "1", device="cuda")
    backend.load()
    config, device = backend.model.seen
    backend.unload()
    assert device == "cuda"
    assert (config.name, config.version, config.max_batch) == ("m", "1", 8)
    assert config.folder == repo / "m" / "1"
    assert [o.name for o in config.outputs] == ["upper", "length"]
    assert config.parameters == {"threshold": 0.5, "labels": ["a", "b"]}


def test_async_methods_are_awaited_on_the_models_thread(repo):
    write_model(
        repo,
        "m",
        """
        import asyncio
        import numpy as np

        class Async:
            async def load(self, config, device):
                self.loop = asyncio.get_running_loop()

            async def predict(self, inputs):
                await asyncio.sleep(0)
                assert asyncio.get_running_loop() is self.loop  # one loop for the version
                n = len(inputs["text"])
                return {"upper": inputs["text"], "length": np.full(n, 7, np.int64)}
        """,
    )
    model = served(repo)
    for i in range(2):
        (result,) = model.run([text_request(i, b"x")], "w").results
        assert result.status is Status.OK and result.outputs[1].to_numpy().tolist() == [7]
    model.unload()


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (
            '{"upper": text, "length": np.zeros((n, 2), np.int64)}',
            "model 'm' version 1 returned shape [3, 2] for output 'length'; config.toml declares "
            "[-1]",
        ),
        (
            '{"upper": text, "length": np.zeros(n, np.float64)}',
            "model 'm' version 1 returned dtype float64 for output 'length'; config.toml "
            "declares INT64 (int64)",
        ),
        (
            '{"upper": text, "length": np.zeros(n - 1, np.int64)}',
            "model 'm' version 1 returned 2 rows for output 'length' given 3 rows",
        ),
        ('{"upper": text}', "model 'm' version 1 returned no output 'length'"),
        (
            '{"upper": text, "length": np.zeros(n, np.int64), "lenght": text}',
            "model 'm' version 1 returned output 'lenght', which config.toml does not declare",
        ),
        (
            '{"upper": text, "length": [0] * n}',
            "model 'm' version 1 returned a list for output 'length', not an array",
        ),
        (
            '{"upper": np.arange(n), "length": np.zeros(n, np.int64)}',
            "model 'm' version 1 returned dtype int64 for output 'upper'; config.toml declares "
            "BYTES",
        ),
        (
            "[text, np.zeros(n, np.int64)]",
            "model 'm' version 1 returned a list from predict, which must return a dict",
        ),
    ],
)
def test_an_output_that_does_not_match_the_config_fails_the_batch_naming_it(
    repo, returned, message
):
    write_model(
        repo,
        "m",
        f"""
        import numpy as np

        class Wrong:
            def predict(self, inputs):
                text = inputs["text"]
                n = len(text)
                return {returned}
        """,
    )
    model = served(repo)
    (result,) = model.run([text_request(0, b"a", b"b", b"c")], "w").results
    model.unload()
    assert result.status is Status.FAILED
    assert result.error.startswith(message), result.error


def test_a_version_whose_warm_up_returns_the_wrong_shape_does_not_load(repo):
    write_model(
        repo,
        "m",
        """
        import numpy as np

        class Wrong:
            def predict(self, inputs):
                return {"y": np.zeros((len(inputs["x"]), 3), np.float32)}
        """,
        io='[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [-1, 4]\n\n'
        '[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [-1, 2]\n',
        warmup=True,
    )
    with pytest.raises(BackendError, match=r"warm-up with 1 rows failed: returned shape \[1, 3\]"):
        served(repo)


RAISES_ON_POISON = """
import numpy as np

class Picky:
    def __init__(self):
        self.calls = 0

    def predict(self, inputs):
        self.calls += 1
        text = inputs["text"]
        if b"poison" in text.tolist():
            raise ValueError("poison in the batch")
        if b"bad" in text.tolist():
            from consumer.backends import InvalidInput
            raise InvalidInput("input 'text' is bad", text.tolist().index(b"bad"))
        return {"upper": text, "length": np.zeros(len(text), np.int64)}
"""


def test_an_exception_on_one_row_fails_that_request_alone_with_its_message(repo):
    write_model(repo, "m", RAISES_ON_POISON)
    model = served(repo)
    batch = [text_request(i, b"poison" if i == 5 else b"ok") for i in range(8)]
    outcome = model.run(batch, "w")
    calls = model.backends["1"].model.calls
    model.unload()
    assert [r.status for r in outcome.results] == [Status.OK] * 5 + [Status.FAILED] + [
        Status.OK
    ] * 2
    error = outcome.results[5].error
    assert (
        error
        == "model 'm' failed: predict raised ValueError: poison in the batch (model.py line 12)"
    )
    assert 1 < calls <= 1 + 2 * 3  # the batch, then at most two halves per level


def test_the_models_own_invalid_input_is_a_client_error_for_that_request(repo):
    write_model(repo, "m", RAISES_ON_POISON)
    model = served(repo)
    outcome = model.run([text_request(0, b"ok"), text_request(1, b"ok", b"bad")], "w")
    model.unload()
    assert [r.status for r in outcome.results] == [Status.OK, Status.INVALID]
    assert outcome.results[1].error == "input 'text' is bad (row 1)"


HANGS_UNTIL_RELEASED = """
import asyncio
import time
from pathlib import Path
import numpy as np

class Hangs:
    def load(self, config, device):
        self.release = config.folder / "release"
        self.calls = 0

    def predict(self, inputs):
        self.calls += 1
        text = inputs["text"]
        if b"hang" in text.tolist():
            limit = time.monotonic() + 60
            while not self.release.exists() and time.monotonic() < limit:
                time.sleep(0.01)  # stands for a call that never returns
        return {"upper": text, "length": np.zeros(len(text), np.int64)}
"""


@pytest.mark.serial  # bounds the refusal time
def test_a_call_past_its_deadline_fails_its_batch_and_the_next_at_once_until_it_returns(repo):
    folder = write_model(repo, "m", HANGS_UNTIL_RELEASED)
    model = served(repo)
    try:
        started = time.monotonic()
        (hung,) = model.run(
            [text_request(0, b"hang")], "w", deadline=time.monotonic() + 0.3
        ).results
        assert hung.status is Status.FAILED and time.monotonic() - started < 2.0
        assert hung.error.startswith("model 'm' version 1: predict did not return by its deadline")
        assert model.backends["1"].model.calls == 1  # not bisected
        # The stuck call still holds the model's thread: the next batch fails at once, unrun.
        started = time.monotonic()
        (refused,) = model.run([text_request(1, b"ok")], "w", deadline=time.monotonic() + 5).results
        assert refused.status is Status.FAILED and time.monotonic() - started < 0.5
        assert "not run: predict overran its deadline" in refused.error
        # Once it returns, the version serves again.
        (folder / "1" / "release").touch()
        deadline = time.monotonic() + 10
        while True:
            (result,) = model.run(
                [text_request(2, b"ok")], "w", deadline=time.monotonic() + 5
            ).results
            if result.status is Status.OK or time.monotonic() > deadline:
                break
        assert result.status is Status.OK, result.error
    finally:
        (folder / "1" / "release").touch()
        model.unload()


def test_an_async_call_past_its_deadline_is_cancelled_and_frees_its_thread(repo):
    write_model(
        repo,
        "m",
        """
        import asyncio
        import numpy as np

        class Waits:
            cancelled = 0

            async def predict(self, inputs):
                text = inputs["text"]
                if b"wait" in text.tolist():
                    try:
                        await asyncio.sleep(60)  # an upstream that never answers
                    except asyncio.CancelledError:
                        Waits.cancelled += 1
                        raise
                return {"upper": text, "length": np.zeros(len(text), np.int64)}
        """,
    )
    model = served(repo)
    (hung,) = model.run([text_request(0, b"wait")], "w", deadline=time.monotonic() + 0.2).results
    assert hung.status is Status.FAILED and hung.error.endswith("cancelled")
    (result,) = model.run([text_request(1, b"ok")], "w", deadline=time.monotonic() + 5).results
    assert result.status is Status.OK, result.error
    assert type(model.backends["1"].model).cancelled == 1
    model.unload()


def test_a_request_larger_than_max_batch_runs_as_calls_of_max_batch_rows(repo):
    write_model(repo, "m", ECHO)
    model = served(repo)
    texts = [str(i).encode() for i in range(20)]
    (result,) = model.run([text_request(0, *texts)], "w").results
    assert result.status is Status.OK and result.outputs[0].to_numpy().tolist() == texts
    assert model.backends["1"].model.calls == [8, 8, 4]
    model.unload()


def test_errors_in_load_and_import_name_the_line_and_the_version_does_not_load(repo):
    write_model(repo, "m", "import not_a_package_anyone_has\n")
    with pytest.raises(
        BackendError,
        match=re.escape(
            "model.py raised ModuleNotFoundError: No module named "
            "'not_a_package_anyone_has' (model.py line 1)"
        ),
    ):
        served(repo)
    write_model(
        repo,
        "n",
        """
        class Fails:
            def load(self, config, device):
                raise RuntimeError("no weights in " + config.folder.name)

            def predict(self, inputs): ...
        """,
    )
    with pytest.raises(
        BackendError, match=r"load raised RuntimeError: no weights in 1 \(model.py line 4\)"
    ):
        served(repo, "n")


@pytest.mark.parametrize(
    ("code", "extra", "message"),
    [
        ("X = 1\n", "", "must define exactly one class with a predict method \\(found none\\)"),
        (
            "class A:\n    def predict(self, i): ...\nclass B:\n    def predict(self, i): ...\n",
            "",
            "found A, B\\); or name one with \\[python\\] class",
        ),
        ("class A:\n    def predict(self, i): ...\n", '[python]\nclass = "B"\n', "no class 'B'"),
    ],
)
def test_the_class_served_is_the_one_defined_or_the_one_named(repo, code, extra, message):
    write_model(repo, "m", code, extra=extra)
    with pytest.raises(BackendError, match=message):
        served(repo)


def test_a_named_class_is_served_among_others(repo):
    code = ECHO + "\nclass Helper:\n    def predict(self, inputs): raise AssertionError\n"
    write_model(repo, "m", code, extra='[python]\nclass = "Echo"\n')
    model = served(repo)
    assert model.run([text_request(0, b"a")], "w").results[0].status is Status.OK
    model.unload()


def test_each_version_is_its_own_module_out_of_sys_path_and_gone_after_unload(repo):
    write_model(repo, "m", "STATE = []\n" + ECHO, versions=("1", "2"))
    before = set(sys.modules)
    one, two = (PythonBackend(load_config(repo, "m"), v) for v in ("1", "2"))
    one.load()
    two.load()
    names = set(sys.modules) - before
    assert len(names) == 2 and all(n.startswith("inferq_model_m_") for n in names)
    first, second = (sys.modules[n] for n in sorted(names))
    assert first is not second and first.STATE is not second.STATE
    assert not any(str(repo) in p for p in sys.path)
    one.unload()
    two.unload()
    assert set(sys.modules) - before == set()


def test_model_code_outside_the_repository_is_refused(tmp_path, repo):
    outside = tmp_path / "elsewhere.py"
    outside.write_text(ECHO)
    folder = write_model(repo, "m", ECHO)
    (folder / "1" / "model.py").unlink()
    (folder / "1" / "model.py").symlink_to(outside)
    with pytest.raises(RepositoryError, match="model file points outside the repository"):
        load_config(repo, "m")


def test_a_symlink_swapped_in_after_the_config_was_read_is_refused_too(tmp_path, repo):
    outside = tmp_path / "elsewhere.py"
    outside.write_text(ECHO)
    folder = write_model(repo, "m", ECHO)
    config = load_config(repo, "m")
    (folder / "1" / "model.py").unlink()
    (folder / "1" / "model.py").symlink_to(outside)
    with pytest.raises(BackendError, match="points outside the model repository"):
        PythonBackend(config, "1").load()


def test_python_settings_are_for_the_python_backend_only(repo):
    write_model(repo, "m", ECHO, extra='[python]\nclass = "not a name"\n')
    with pytest.raises(RepositoryError, match=r"field 'python\.class' must be a class name"):
        load_config(repo, "m")
    folder = repo / "sim"
    (folder / "1").mkdir(parents=True)
    (folder / "config.toml").write_text('backend = "simulated"\n[python]\nclass = "A"\n' + TEXT_IO)
    with pytest.raises(RepositoryError, match="field 'python' is for backend = \"python\" only"):
        load_config(repo, "sim")


@pytest.mark.serial  # bounds the unload time
def test_unload_abandons_a_stuck_thread_without_waiting_for_it(repo):
    folder = write_model(repo, "m", HANGS_UNTIL_RELEASED)
    model = served(repo)
    model.run([text_request(0, b"hang")], "w", deadline=time.monotonic() + 0.2)
    started = time.monotonic()
    model.unload()
    assert time.monotonic() - started < 1.0
    (folder / "1" / "release").touch()
    stuck = [t for t in threading.enumerate() if t.name == "python-m-1"]
    for t in stuck:
        t.join(5)
    assert not any(t.is_alive() for t in stuck)
