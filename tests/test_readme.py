"""The README and the guides in docs/, as a newcomer reads them: each ``inferq`` command parses
with the real CLI, the commands are on the PATH before they are used, curl bodies name their
Content-Type, the Redis recipes give every server its own folder and keep off 6379, the HTTP API
names the gateway's routes, every link leads somewhere, and the loadgen snippet measures the
model, not the result cache. (tests/docs/ runs the blocks marked runnable against a live stack.)"""

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
from tests.docs.runnable import ROOT, blocks

README = ROOT / "README.md"
TEXT = README.read_text()
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
GUIDES_OF_OTHERS = {
    # Guides the README links that other branches write (their links may land before them).
    "batches.md",
    "webhooks.md",
    "events.md",
    "client.md",
    "console.md",
    "serverless.md",
    "on-demand.md",
    "model-control.md",
}


def code(*languages: str, pages: list[Path] = PAGES) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block in those languages."""
    return [(b.language, b.body) for p in pages for b in blocks(p) if b.language in languages]


def shell_lines(pages: list[Path] = PAGES) -> list[str]:
    """Every command of the shell blocks (``sh``, ``bash``; in ``text`` and plain blocks, the
    lines after a ``$`` prompt), continuation lines joined."""
    commands = []
    for lang, body in code("sh", "bash", "text", "", pages=pages):
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


def test_every_inferq_command_in_the_readme_and_guides_parses_with_the_real_cli():
    commands = inferq_commands()
    assert len(commands) > 15
    assert any(argv[1] == "dlq" for argv in commands)  # the README shows inferq dlq
    for argv in commands:
        try:
            parse(argv[1:], {})
        except SystemExit as e:  # a usage error: argparse has printed why
            pytest.fail(f"`{shlex.join(argv)}` exits {e.code}")


def test_the_readme_says_how_to_get_the_commands_on_the_path_before_using_them():
    used = [line for line in shell_lines([README]) if line.startswith(("inferq ", "locust "))]
    used += [line for line in shell_lines([README]) if "inferq " in line and "$(" in line]
    first_use = min(TEXT.index(line[:15]) for line in used)  # as written, before any "\\"
    assert TEXT.index(". .venv/bin/activate") < first_use
    # ... and at the Redis make run printed, before any command that reads it
    assert TEXT.index("export INFERQ_REDIS_URL=") < first_use


def test_every_curl_that_sends_v2_json_names_its_content_type():
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
    text = (DOCS / "scaling.md").read_text()
    start = text.index(f"## {heading}\n")
    body = text[start : text.index("\n## ", start + 1)]
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


def test_the_readmes_http_api_names_every_route_of_the_gateway():
    section = TEXT[TEXT.index("### The HTTP API") : TEXT.index("### OpenAPI and `/docs`")]
    table = "".join(re.findall(r"^\|.*\|$", section, flags=re.M))
    for route in routes():
        path = route.path.replace("{model}", "{m}").replace("{version}", "{v}")  # as written
        path = path.replace("{job}", "{id}").replace("{batch}", "{id}")
        path = path.replace("/versions/{v}", "")  # written [/versions/{v}]
        if route.path.startswith("/docs/"):
            continue  # Swagger UI's own assets, loaded by /docs
        if not isinstance(route, ApiRoute) and "{" not in route.path:
            assert f"`GET {route.path}`" in section, route.path
        assert path.removeprefix("/v2/models/{m}") in table, route.path


def test_the_configuration_table_names_every_flag_and_its_variable():
    import argparse

    from inferq.cli import build_parser

    rows = re.findall(r"^\| (`--[^|]*)\| ([^|]*)\|", (DOCS / "configuration.md").read_text(), re.M)
    table = {
        flag: set(re.findall(r"`(INFERQ_\w+)`", envs))
        for flags, envs in rows
        for flag in re.findall(r"`(--[\w-]+)`", flags)
    }
    (commands,) = [
        a for a in build_parser({})._actions if isinstance(a, argparse._SubParsersAction)
    ]
    for name in ("up", "gateway", "worker"):
        for action in commands.choices[name]._actions:
            if action.help == argparse.SUPPRESS or not action.option_strings:
                continue
            flag = action.option_strings[-1]
            if flag == "--help":
                continue
            assert flag in table, f"inferq {name} {flag} is not in docs/configuration.md"
            env = re.search(r"\[env (INFERQ_\w+)\]", action.help or "")
            assert env and env.group(1) in table[flag], (name, flag)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    inside, found = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside and (m := re.match(r"#{1,6} (.*)", line)):
            found.add(slug(m.group(1)))
    return found


@pytest.mark.parametrize(
    "page", [*PAGES, ROOT / "ARCHITECTURE.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"\w+:", link):
            continue  # http(s), mailto
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if path.parent == DOCS and path.name in GUIDES_OF_OTHERS and not path.exists():
            continue
        assert path.exists(), f"{page.name}: {link}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page.name}: {link}"


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
    (snippet,) = [
        body
        for _, body in code("python", pages=[DOCS / "load-testing.md"])
        if "run_closed_loop" in body
    ]
    code_ = snippet.replace("http://127.0.0.1:8000", s.url).replace("duration_s=10", "duration_s=1")
    namespace: dict[str, object] = {"print": lambda *args: None}
    exec(compile(code_, "docs/load-testing.md", "exec"), namespace)
    runs = [namespace["closed"], namespace["opened"]]
    sent = sum(run.requests + run.warmup_requests for run in runs)  # type: ignore[attr-defined]
    assert all(run.ok == run.requests > 0 for run in runs)  # type: ignore[attr-defined]
    gateway = httpx.get(f"{s.url}/metrics", timeout=10).text
    worker = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    # digits' config turns its result cache on: the snippet must not measure it.
    assert counter(gateway, "inferq_gateway_cache_hits") == 0
    assert counter(worker, "inferq_worker_requests") == sent
