"""docs/model-control.md's walkthrough works as written on a fresh checkout: its two shell
blocks run, unchanged but for the addresses, against a real ``inferq up`` serving a copy of the
checkout's committed ``models/`` (the walkthrough copies folders inside it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from inferq.redisserver import RedisServer, free_port
from tests.conftest import REPO_ROOT
from tests.support import wait_until

DOC = REPO_ROOT / "docs" / "model-control.md"


def bash_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def test_the_walkthrough_has_a_server_block_and_a_client_block():
    server, client = bash_blocks()
    assert "inferq up" in server.splitlines()
    assert re.search(r"^URL=http://127\.0\.0\.1:8000 ", client, flags=re.M)
    assert re.search(r"^REDIS=redis://127\.0\.0\.1:6379 ", client, flags=re.M)
    # It creates the versions and folders it loads (the README's old walkthrough asked for a
    # models/digits/2 that does not exist on a fresh checkout).
    assert client.index("cp -r models/digits/1 models/digits/2") < client.index('"version": "2"')
    assert client.index("cp -r models/digits models/digits-copy") < client.index("digits-copy/load")


def fresh_checkout(root: Path) -> None:
    """The committed files of ``models/`` (what a clone has, nothing built), and the venv."""
    tracked = subprocess.run(
        ["git", "ls-files", "models"], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    for name in tracked:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, root / name)
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent, target_is_directory=True)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_walkthrough_runs_as_written_on_a_fresh_checkout(tmp_path, capsys):
    server_block, client_block = bash_blocks()
    fresh_checkout(tmp_path)
    redis = RedisServer().start()  # its own: the walkthrough uses the default namespace
    port = free_port()
    env = {
        **os.environ,
        # This checkout's code, whichever checkout the editable install points at.
        "PYTHONPATH": str(REPO_ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("INFERQ_ADMIN_TOKEN", None)
    server_script = server_block.replace(
        "\ninferq up\n",
        f"\nexec inferq up --redis {redis.url} --port {port} --grpc-port 0 --metrics-port 0\n",
    )
    server = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", server_script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(server.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_until(
            lambda: (
                any("inferq is serving at" in line for line in printed) or server.poll() is not None
            ),
            120,
            "inferq up to serve",
        )
        assert server.poll() is None, "".join(printed)
        client_script = re.sub(
            r"^URL=\S+", f"URL=http://127.0.0.1:{port}", client_block, count=1, flags=re.M
        )
        client_script = re.sub(
            r"^REDIS=\S+", f"REDIS={redis.url}", client_script, count=1, flags=re.M
        )
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", client_script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        with capsys.disabled():
            print(f"\nmodel-control walkthrough (exit {run.returncode}):\n{run.stdout[-3000:]}")
        assert run.returncode == 0, run.stdout + run.stderr + "".join(printed[-40:])
        out = run.stdout
        assert '"name":"digits","version":"1","state":"READY"' in out
        assert '"name":"minilm","state":"UNAVAILABLE"' in out  # not built on a fresh checkout
        assert '"model_name":"digits","model_version":"2"' in out  # after the hot swap
        assert "1: 90%, 2: 10%" in out  # inferq models list during the canary
        assert "digits: back to its repository config; serves 2" in out
        assert '"model_name":"digits-copy"' in out
        assert '"max_batch_size":64' in out and '"model_stats":[' in out
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(60)
        finally:
            reader.join(5)
            if server.stdout is not None:
                server.stdout.close()
            redis.stop()
