"""How runnable blocks are found, aimed at a live stack, run and compared (``runnable.py``),
without a stack: so that the live test fails when a document is wrong, and only then."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runnable import ROOT, Command, Live, Outcome, Shell, blocks, rewrite, shown_in

PAGE = """# A page

<!-- runnable -->
```text
$ curl -si -X POST localhost:8000/v2/models/digits/jobs \\
    -d "$D"
HTTP/1.1 202 Accepted
location: /v2/jobs/AaIz4wmsC_7f6h9gTZLxcqpqy36grUGO

{"id":"AaIz4wmsC_7f6h9gTZLxcqpqy36grUGO","status":"queued"}
$ inferq lag
```

```sh
not marked
```

<!-- runnable -->
```sh
export A=1
```
"""


@pytest.fixture
def page(tmp_path: Path) -> Path:
    path = tmp_path / "page.md"
    path.write_text(PAGE)
    return path


def test_a_block_is_runnable_when_the_marker_is_the_line_before_its_fence(page):
    found = blocks(page)
    assert [(b.language, b.runnable) for b in found] == [
        ("text", True),
        ("sh", False),
        ("sh", True),
    ]
    assert (found[0].line, found[0].end) == (4, 12)


def test_a_transcripts_commands_carry_their_continuation_lines_and_what_they_printed(page):
    first, second = blocks(page)[0].commands()
    assert first.text == 'curl -si -X POST localhost:8000/v2/models/digits/jobs \\\n    -d "$D"'
    assert first.shown[0] == "HTTP/1.1 202 Accepted" and len(first.shown) == 3  # blank dropped
    assert (first.line, second.line, second.shown) == (5, 11, ())
    (script,) = blocks(page)[2].commands()
    assert script.text == "export A=1\n"


def test_a_block_that_never_closes_is_an_error(tmp_path):
    path = tmp_path / "broken.md"
    path.write_text("```sh\necho\n")
    with pytest.raises(ValueError, match="never closes"):
        blocks(path)


PRINTED = """HTTP/1.1 202 Accepted\r
date: Tue, 01 Dec 2026 23:14:06 GMT\r
location: /v2/jobs/AaIz5XXXXXXXXXXXXXXXXXXXXXXXXXXX\r
\r
{"id":"AaIz5XXXXXXXXXXXXXXXXXXXXXXXXXXX","status":"queued"}"""


def test_what_a_transcript_shows_must_be_printed_in_order_with_ids_and_times_masked():
    shown = (
        "HTTP/1.1 202 Accepted",
        "location: /v2/jobs/AaIz4wmsC_7f6h9gTZLxcqpqy36grUGO",
        '{"id":"AaIz4wmsC_7f6h9gTZLxcqpqy36grUGO","status":"queued"}',
    )
    assert shown_in(shown, PRINTED) is None  # a header the document leaves out is fine
    assert shown_in(("HTTP/1.1 200 OK",), PRINTED) == "HTTP/1.1 200 OK"
    assert shown_in(tuple(reversed(shown)), PRINTED) is not None  # order matters
    assert shown_in(('{"id":"...","status":"queued"}',), PRINTED) is None  # ... is anything
    assert shown_in(('{"id":"...","status":"succeeded"}',), PRINTED) is not None


@pytest.mark.parametrize(
    ("shown", "printed"),
    [
        ("at 2026-12-01 23:14:08 UTC (Redis clock)", "at 2027-01-02 01:02:03 UTC (Redis clock)"),
        ('"created_at":"2026-12-01T23:14:07.072Z"', '"created_at":"2026-12-02T00:00:00.001Z"'),
        ("  1796166849002-0  request (undecodable)", "1796166990000-12 request (undecodable)"),
        (
            "  vm-2552-353a61-0  1  gen 0 ok  23:14:05",
            "ci-host.local-77-0a9f3c-0 1 gen 0 ok 08:00:00",
        ),
        (
            "digits  low  300  298  2  300  0  12.3s  0.0  stalled",
            "digits low 300 298 2 300 0 950ms 0.0 stalled",
        ),
    ],
)
def test_values_that_differ_from_run_to_run_are_masked(shown, printed):
    assert shown_in((shown,), printed) is None


def test_numbers_that_say_something_are_compared():
    assert shown_in(("digits: 1 dead letter(s)",), "digits: 2 dead letter(s)") is not None
    assert shown_in(('"data":[0]',), '"data":[8]') is not None


def test_documented_addresses_become_the_live_ones():
    live = Live("127.0.0.1:41234", "redis://127.0.0.1:5555/0", lambda: [11, 12])
    command = (
        "curl localhost:8000/v2 http://127.0.0.1:8000/v2; "
        "export INFERQ_REDIS_URL=redis://127.0.0.1:47085/0; "
        "pkill -STOP -f 'inferq worker'; pkill -CONT -f 'inferq worker'"
    )
    assert live.command(command) == (
        "curl 127.0.0.1:41234/v2 http://127.0.0.1:41234/v2; "
        "export INFERQ_REDIS_URL=redis://127.0.0.1:5555/0; kill -STOP 11 12; kill -CONT 11 12"
    )
    assert live.documented("at http://127.0.0.1:41234", "redis://x") == "at http://127.0.0.1:8000"


def test_writing_back_replaces_each_commands_output_and_leaves_out_noise_headers(page):
    live = Live("127.0.0.1:41234", "redis://127.0.0.1:5555/0", list)
    transcript = blocks(page)[0]
    first, second = transcript.commands()
    outcomes = [
        Outcome(transcript, first, 0, PRINTED.replace("202 Accepted", "202 Accepted (new)")),
        Outcome(transcript, second, 0, "MODEL LANE"),
    ]
    written = rewrite(page, outcomes, live).splitlines()
    start = written.index("```text")
    assert written[start + 1 : start + 11] == [
        "$ curl -si -X POST localhost:8000/v2/models/digits/jobs \\",
        '    -d "$D"',
        "HTTP/1.1 202 Accepted (new)",
        "location: /v2/jobs/AaIz5XXXXXXXXXXXXXXXXXXXXXXXXXXX",
        "",
        '{"id":"AaIz5XXXXXXXXXXXXXXXXXXXXXXXXXXX","status":"queued"}',
        "$ inferq lag",
        "MODEL LANE",
        "```",
        "",
    ]
    assert "\n".join(written[start + 10 :]) == PAGE.split("$ inferq lag\n```\n", 1)[1].rstrip()


def test_the_shell_keeps_its_variables_and_reports_each_commands_status():
    shell = Shell(ROOT, {"PATH": "/usr/bin:/bin"})
    try:
        assert shell.run("X=hello") == (0, "")
        assert shell.run('echo "$X"; false') == (1, "hello")
        assert shell.run("echo no newline >&2; printf tail") == (0, "no newline\ntail")
        status, printed = shell.run("echo before\nfalse\necho after", strict=True)
        assert status is None and "after" not in printed  # a failing line ends the session
    finally:
        shell.close()


def test_the_commands_line_numbers_point_into_the_document(page):
    (block,) = [b for b in blocks(page) if b.language == "text"]
    command: Command = block.commands()[1]
    assert page.read_text().splitlines()[command.line - 1] == "$ inferq lag"
