"""The README's commands, as a newcomer types them: each ``inferq`` command parses with the real
CLI, the commands are on the PATH before they are used, curl bodies name their Content-Type, the
Redis recipes give every server its own folder and keep off 6379, and the loadgen snippet
measures the model, not the result cache."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferq.cli import parse
from producer.app import routes
from producer.openapi import ApiRoute

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()


def blocks(*languages: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block in those languages."""
    found = re.findall(r"^```(\w*)\n(.*?)^```", TEXT, flags=re.S | re.M)
    return [(lang, body) for lang, body in found if lang in languages]


def shell_lines() -> list[str]:
    """Every command of the README's shell blocks (``sh``, ``bash``; in ``text`` and plain
    blocks, the lines after a ``$`` prompt), continuation lines joined."""
    commands = []
    for lang, body in blocks("sh", "bash", "text", ""):
        lines = iter(body.splitlines())
        for line in lines:
            if lang in ("text", ""):
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            while line.rstrip().endswith("\\"):
                line = line.rstrip()[:-1] + " " + next(lines).strip()
            commands.append(line.strip())
    return commands


def inferq_commands() -> list[list[str]]:
    return [
        shlex.split(line, comments=True)
        for line in shell_lines()
        if line.startswith("inferq ") and "$(" not in line
    ]


def test_every_inferq_command_in_the_readme_parses_with_the_real_cli():
    commands = inferq_commands()
    assert len(commands) > 15
    assert any(argv[1] == "dlq" for argv in commands)  # the README shows inferq dlq
    for argv in commands:
        try:
            parse(argv[1:], {})
        except SystemExit as e:  # a usage error: argparse has printed why
            pytest.fail(f"README: `{shlex.join(argv)}` exits {e.code}")


def test_the_readme_says_how_to_get_the_commands_on_the_path_before_using_them():
    used = [line for line in shell_lines() if line.startswith(("inferq ", "locust "))]
    first_use = min(TEXT.index(line[:15]) for line in used)  # as written, before any "\\"
    assert TEXT.index(". .venv/bin/activate") < first_use


def test_every_readme_curl_that_sends_v2_json_names_its_content_type():
    # curl -d sends application/x-www-form-urlencoded, which inference routes answer with 415.
    sending = [
        line
        for line in shell_lines()
        if line.startswith("curl ")
        and re.search(r"/v2/models/[^ ]*/(infer|jobs)", line)
        and re.search(r"\s(-d|--data\S*)\s", line)
    ]
    assert len(sending) >= 3
    for line in sending:
        assert re.search(r"-H '[Cc]ontent-[Tt]ype: application/json'", line), line


def redis_recipe(heading: str) -> str:
    start = TEXT.index(f"### {heading}\n")
    body = TEXT[start : TEXT.index("\n### ", start + 1)]
    (block,) = re.findall(r"```sh\n(.*?)```", body, flags=re.S)
    return str(block)


@pytest.mark.parametrize("heading", ["Redis with a replica", "Redis Cluster"])
def test_the_redis_recipes_give_each_server_its_own_folder_and_keep_off_6379(heading):
    recipe = redis_recipe(heading)
    servers = [line for line in recipe.replace("\\\n", " ").splitlines() if "redis-server" in line]
    assert servers
    folders = []
    for line in servers:
        argv = shlex.split(line, comments=True)
        port = argv[argv.index("--port") + 1]
        folder = argv[argv.index("--dir") + 1]
        assert port in folder, line  # one folder per port: AOFs and node files never mix
        folders.append(folder)
    assert len(set(folders)) == len(folders)
    assert "6379" not in recipe  # a Redis may already listen there (this machine's does)


def test_the_readme_names_the_gateways_routes_outside_the_v2_protocol():
    section = TEXT[TEXT.index("## HTTP API") : TEXT.index("## gRPC API")]
    for route in routes():
        if not isinstance(route, ApiRoute) and "{" not in route.path:
            assert f"`GET {route.path}`" in section, route.path


def counter(text: str, name: str) -> float:
    """A counter's total over every label set in a scrape (``name`` without ``_total``)."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if s.name == f"{name}_total"
    )


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_loadgen_snippet_runs_every_request_on_a_worker(stack):
    from inferq.redisserver import free_port

    metrics_port = free_port()
    s = stack(workers=0)
    s.add_worker(("digits",), metrics_port=metrics_port)
    s.wait_ready("digits")
    (snippet,) = [body for _, body in blocks("python") if "run_closed_loop" in body]
    code = snippet.replace("http://127.0.0.1:8000", s.url).replace("duration_s=10", "duration_s=1")
    namespace: dict[str, object] = {"print": lambda *args: None}
    exec(compile(code, "README.md", "exec"), namespace)
    runs = [namespace["closed"], namespace["opened"]]
    sent = sum(run.requests + run.warmup_requests for run in runs)  # type: ignore[attr-defined]
    assert all(run.ok == run.requests > 0 for run in runs)  # type: ignore[attr-defined]
    gateway = httpx.get(f"{s.url}/metrics", timeout=10).text
    worker = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    # digits' config turns its result cache on: the snippet must not measure it.
    assert counter(gateway, "inferq_gateway_cache_hits") == 0
    assert counter(worker, "inferq_worker_requests") == sent
