"""Batches against real workers: JSONL in, every line answered once, in input order; malformed
lines become error lines with their numbers; cancel, list, delete; limits. (A gateway killed
mid-batch: tests/chaos/test_batches.py.)"""

from __future__ import annotations

import json

from inferq.cli import main
from tests.support import sim_body, wait_until

FINAL = {"completed", "failed", "expired", "cancelled"}


def line(i: int, model: str = "sim") -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": f"/v2/models/{model}/infer",
        "body": sim_body(float(i % 97), rows=1),
    }


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def create(client, lines: list, **params):
    return client.post(
        "/v2/batches",
        content=jsonl(lines),
        params=params,
        headers={"content-type": "application/jsonl"},
    )


def wait_final(client, batch_id: str, timeout_s: float = 120) -> dict:
    seen: dict = {}

    def final() -> bool:
        seen.update(client.get(f"/v2/batches/{batch_id}").json())
        return seen["status"] in FINAL

    wait_until(final, timeout_s=timeout_s, what=f"batch {batch_id} to end")
    return seen


def answers(client, batch_id: str, part: str) -> list[dict]:
    r = client.get(f"/v2/batches/{batch_id}/{part}")
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.text.splitlines() if x]


def test_every_line_is_answered_once_in_order_and_equals_sync_infer(stack):
    s = stack(models=("sim",))
    n = 1000
    with s.client() as c:
        r = create(c, [line(i) for i in range(n)], metadata='{"team":"a"}')
        assert r.status_code == 202, r.text
        batch = r.json()
        assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == n
        assert batch["metadata"] == {"team": "a"}
        assert r.headers["location"] == f"/v2/batches/{batch['id']}"
        done = wait_final(c, batch["id"])
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
        assert done["in_progress_at"] and done["finalizing_at"] and done["completed_at"]
        out = answers(c, batch["id"], "output")
        assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(n)]
        assert answers(c, batch["id"], "errors") == []
        for i in (0, 1, 500, n - 1):
            sync = s.infer("sim", sim_body(float(i % 97), rows=1)).json()
            got = out[i]["response"]
            assert got["status_code"] == 200
            assert got["body"]["outputs"] == sync["outputs"]


def test_malformed_lines_become_error_lines_with_their_numbers(stack):
    s = stack(models=("sim",))
    lines: list = []
    bad_at = set()
    for i in range(150):
        if i % 3 == 0 and len(bad_at) < 50:
            kind = len(bad_at) % 5
            bad = [
                b"{not json",
                json.dumps({"custom_id": f"b{i}", "url": "/v2/nope", "body": {}}).encode(),
                json.dumps({**line(i), "body": {"inputs": "x"}}).encode(),
                json.dumps(line(i, model="no-such-model")).encode(),
                json.dumps({**line(i), "custom_id": "req-1"}).encode(),  # a duplicate id
            ][kind]
            lines.append(bad)
            bad_at.add(i + 1)
        else:
            lines.append(line(i))
    with s.client() as c:
        r = create(c, lines)
        assert r.status_code == 202, r.text
        done = wait_final(c, r.json()["id"])
        assert done["request_counts"] == {"total": 150, "completed": 100, "failed": 50}
        errors = answers(c, done["id"], "errors")
        assert {e["line"] for e in errors} == bad_at
        for e in errors:
            assert e["error"]["code"] == "invalid_request"
            assert e["error"]["message"].startswith(f"line {e['line']}")
        assert len(answers(c, done["id"], "output")) == 100


def test_bare_v2_lines_use_the_default_model_and_a_json_body_works_too(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        r = c.post(
            "/v2/batches",
            json={"model": "sim", "requests": [sim_body(1.0), {**sim_body(2.0), "id": "two"}]},
        )
        assert r.status_code == 202, r.text
        done = wait_final(c, r.json()["id"])
        assert done["model"] == "sim" and done["request_counts"]["completed"] == 2
        assert [o["custom_id"] for o in answers(c, done["id"], "output")] == ["1", "two"]


def test_limits_are_named_in_the_refusal(stack):
    s = stack(models=("sim",), max_batch_lines=3, max_batch_bytes=4000, max_batches_in_flight=1)
    with s.client() as c:
        r = create(c, [line(i) for i in range(4)])
        assert r.status_code == 413 and "--max-batch-lines" in r.json()["error"]
        r = create(c, [line(1), {"custom_id": "big", "body": {"x": "y" * 5000}}])
        assert r.status_code == 413 and "--max-batch-bytes" in r.json()["error"]
        with s.workers[0].paused():
            assert create(c, [line(1)]).status_code == 202
            r = create(c, [line(2)])
            assert r.status_code == 429 and "--max-batches-in-flight" in r.json()["error"]
            assert "retry-after" in r.headers
        assert create(c, []).status_code == 400


def test_cancel_stops_what_has_not_started_and_delete_removes_a_finished_batch(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        with s.workers[0].paused():
            r = create(c, [line(i) for i in range(50)])
            batch_id = r.json()["id"]
            assert c.delete(f"/v2/batches/{batch_id}").status_code == 409
            r = c.post(f"/v2/batches/{batch_id}/cancel")
            assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
            done = wait_final(c, batch_id)
        assert done["status"] == "cancelled"
        counts = done["request_counts"]
        assert counts["completed"] + counts["failed"] == 50 and counts["failed"] > 0
        codes = {e["error"]["code"] for e in answers(c, batch_id, "errors")}
        assert codes <= {"cancelled", "batch_cancelled"}
        assert c.post(f"/v2/batches/{batch_id}/cancel").status_code == 200  # still cancelled
        listed = c.get("/v2/batches", params={"limit": 1}).json()
        assert listed["data"][0]["id"] == batch_id
        assert c.delete(f"/v2/batches/{batch_id}").json()["deleted"] is True
        assert c.get(f"/v2/batches/{batch_id}").status_code == 404
        assert c.get(f"/v2/batches/{batch_id}/output").status_code == 404


def test_listing_pages_newest_first(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        ids = [create(c, [line(i)]).json()["id"] for i in range(3)]
        page = c.get("/v2/batches", params={"limit": 2}).json()
        assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"]
        rest = c.get("/v2/batches", params={"limit": 2, "after": page["last_id"]}).json()
        assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]
        assert c.get("/v2/batches", params={"limit": "x"}).status_code == 400


def test_inferq_lag_and_the_metrics_show_batches_in_flight_and_lines_pending(
    stack, redis_url, namespace, capsys
):
    s = stack(models=("sim",))
    registry = s.gateway.gateway.metrics.registry
    with s.client() as c, s.workers[0].paused():
        create(c, [line(i) for i in range(10)])
        wait_until(  # both gauges follow the same refresh, which may land between them
            lambda: (
                registry.get_sample_value("inferq_gateway_batch_lines_pending") == 10
                and registry.get_sample_value("inferq_gateway_batches_in_flight") == 1
            ),
            what="the pending and in-flight gauges",
        )
        capsys.readouterr()
        args = ["lag", "--redis", redis_url, "--namespace", namespace, "--sample-s", "0"]
        assert main([*args, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert doc["batches"] == {"in_flight": 1, "lines_pending": 10}
        assert main(args) == 0
        assert "batches: 1 in flight, 10 lines pending" in capsys.readouterr().out


def test_a_batch_larger_than_the_job_backlog_is_paced_not_refused(stack):
    s = stack(models=("slow",), max_job_backlog=8)
    with s.client() as c:
        r = create(c, [line(i, model="slow") for i in range(200)])
        assert r.status_code == 202, r.text
        done = wait_final(c, r.json()["id"])
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
    registry = s.gateway.gateway.metrics.registry
    paced = registry.get_sample_value("inferq_gateway_batch_paced_total")
    assert paced, "the backlog never filled: the test did not test pacing"
