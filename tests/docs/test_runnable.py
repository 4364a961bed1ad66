"""The README's runnable blocks (and those of docs/*.md) run as written against a live
``inferq up``: every command exits 0 and prints what the document shows (``runnable.py`` says
how blocks are marked, aimed at the live stack and compared). So the documents cannot go stale
without this test failing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runnable import (
    ROOT,
    Shell,
    documents,
    live_stack,
    run_document,
    runnable,
    shell_env,
    shown_in,
)

# serial: runs the docs' commands, `inferq up` included, with their timeouts.
pytestmark = pytest.mark.serial

README = ROOT / "README.md"


def test_the_readme_marks_the_blocks_a_newcomer_pastes():
    marked = runnable(README)
    commands = [c.text for b in marked for c in b.commands()]
    assert len(marked) >= 10
    for used in ("curl -s -X POST", "/jobs", "DELETE", "inferq lag", "inferq dlq", "inferq models"):
        assert any(used in c for c in commands), used


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runnable_blocks_run_as_written(document: Path):
    failures: list[str] = []
    ran = 0
    with live_stack() as live:
        shell = Shell(ROOT, shell_env())
        try:
            for o in run_document(document, live, shell):
                ran += 1
                where = o.block.where(o.command.line)
                if o.status != 0:
                    failures.append(f"{where}: `{o.command.text}` exited {o.status}:\n{o.printed}")
                elif o.block.transcript and (missing := shown_in(o.command.shown, o.printed)):
                    failures.append(
                        f"{where}: `{o.command.text}` did not print\n  {missing}\nit printed:\n"
                        f"{o.printed}"
                    )
        finally:
            shell.close()
    assert not failures, "\n\n".join(failures)
    assert ran == sum(len(b.commands()) for b in runnable(document))
