"""The operator console's JSON views and actions (``producer.console``) on a real gateway,
workers and Redis: who may read and act, what each view shows, and a Redis outage."""

from __future__ import annotations

import pytest
import redis

from producer.console import ASSETS as console_assets
from protocol.keys import Keys, Lane
from protocol.messages import DeadLetter
from tests.support import sim_body, sim_request, wait_until

ADMIN, READER = "admin-secret-token", "reader-token"


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def console(stack):
    s = stack(workers=1, admin_token=ADMIN, console_token=READER)
    s.wait_ready("sim")
    return s


def test_every_view_needs_a_token_and_the_page_carries_no_secret(console):
    with console.client() as c:
        page = c.get("/console")
        assert page.status_code == 200
        assert ADMIN not in page.text and READER not in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for view in ("overview", "workers", "jobs", "deadletters", "models", "whoami"):
            assert c.get(f"/console/api/{view}").status_code == 401, view
            assert c.get(f"/console/api/{view}", headers=bearer("wrong")).status_code == 403
            r = c.get(f"/console/api/{view}", headers=bearer(READER))
            assert r.status_code == 200, (view, r.text)
            assert ADMIN not in r.text and READER not in r.text
            assert console.redis_url not in r.text
        assert c.get("/console/api/whoami", headers=bearer(ADMIN)).json()["role"] == "admin"
        assert c.get("/console/api/whoami", headers=bearer(READER)).json()["role"] == "read"


def test_the_console_is_off_without_any_token(stack):
    s = stack(workers=0)
    with s.client() as c:
        r = c.get("/console/api/overview", headers=bearer("anything"))
        assert r.status_code == 403
        assert "--console-token" in r.json()["error"]


def dead_letter(s, reason: str, payload: bytes) -> str:
    keys = Keys(s.namespace)
    r = redis.Redis.from_url(s.redis_url)
    letter = DeadLetter(keys.stream("sim", Lane.NORMAL), "1-0", reason, payload)
    entry = r.xadd(keys.dlq("sim"), letter.to_fields())
    return entry.decode()


def test_the_read_only_token_cannot_act_and_actions_are_posts(console):
    entry = dead_letter(console, "undecodable", b"junk")
    with console.client() as c:
        url = "/console/api/deadletters/sim/retry"
        assert c.get(url, headers=bearer(ADMIN)).status_code == 405
        r = c.post(url, json={"ids": [entry]}, headers=bearer(READER))
        assert r.status_code == 403
        listed = c.get("/console/api/deadletters", headers=bearer(READER)).json()
        assert [e["id"] for m in listed["models"] for e in m["entries"]] == [entry]


def test_a_dead_letter_retried_from_the_console_is_answered(console):
    # A real request, dead-lettered by hand with its payload as the worker would keep it.
    keys = Keys(console.namespace)
    r = redis.Redis.from_url(console.redis_url)
    now_ms = int(r.time()[0]) * 1000
    request = sim_request(keys, "replayed-1", now_ms, value=2.0)
    fields = DeadLetter(
        keys.stream("sim", Lane.NORMAL),
        "1-0",
        "the request was delivered 3 times without completing",
        request.encode(),
    ).to_fields()
    entry = r.xadd(keys.dlq("sim"), fields).decode()
    with console.client() as c:
        listed = c.get("/console/api/deadletters", headers=bearer(READER)).json()
        (letter,) = listed["models"][0]["entries"]
        assert letter["deliveries"] == 3
        assert letter["request"]["id"] == "replayed-1"
        assert "2.0" in letter["preview"]
        done = c.post(
            "/console/api/deadletters/sim/retry", json={"ids": [entry]}, headers=bearer(ADMIN)
        )
        assert done.status_code == 200, done.text
        assert done.json()["replayed"] == 1
    wait_until(lambda: r.exists(keys.result("replayed-1")), 10, "the replayed request's result")
    assert r.xlen(keys.dlq("sim")) == 0


def test_failed_jobs_are_found_by_model_and_status_newest_first(stack):
    s = stack(workers=1, admin_token=ADMIN)
    s.wait_ready("broken")
    s.wait_ready("sim")
    with s.client() as c:
        ids = {}
        for model in ("sim", "broken", "sim", "broken"):
            r = c.post(f"/v2/models/{model}/jobs", json=sim_body(1.0))
            assert r.status_code == 202, r.text
            ids.setdefault(model, []).append(r.json()["id"])
        for job_id in ids["broken"] + ids["sim"]:
            c.get(f"/v2/jobs/{job_id}", params={"wait": 10})
        page = c.get(
            "/console/api/jobs",
            params={"model": "broken", "status": "failed"},
            headers=bearer(ADMIN),
        ).json()
        assert [j["id"] for j in page["jobs"]] == list(reversed(ids["broken"]))
        assert all(j["error"] for j in page["jobs"])
        first = c.get("/console/api/jobs", params={"limit": 1}, headers=bearer(ADMIN)).json()
        second = c.get(
            "/console/api/jobs",
            params={"limit": 5, "cursor": first["cursor"]},
            headers=bearer(ADMIN),
        ).json()
        listed = [j["id"] for j in first["jobs"] + second["jobs"]]
        assert len(set(listed)) == 4 and second["cursor"] is None
        detail = c.get(f"/console/api/jobs/{ids['broken'][0]}", headers=bearer(ADMIN)).json()
        assert [e["status"] for e in detail["events"]] == ["queued", "running", "failed"]
        assert detail["job"]["error"]
        assert (
            c.get("/console/api/jobs", params={"status": "nope"}, headers=bearer(ADMIN)).status_code
            == 400
        )


def test_the_overview_shows_models_versions_and_backlog(console):
    with console.client() as c:
        assert console.infer("sim", sim_body(1.0)).status_code == 200
        doc = c.get("/console/api/overview", headers=bearer(READER)).json()
        sim = next(m for m in doc["models"] if m["name"] == "sim")
        assert sim["workers"] == 1 and sim["ready"]
        assert sim["versions"][0]["version"] == "1" and sim["versions"][0]["share"] == 1.0
        assert {lane["lane"] for lane in sim["lanes"]} == {"high", "normal", "low"}
        workers = c.get("/console/api/workers", headers=bearer(READER)).json()["workers"]
        assert len(workers) == 1 and workers[0]["live"]
        assert workers[0]["heartbeat_expires_in_ms"] > 0


def test_a_worker_shows_its_memory_and_how_often_inferq_up_restarted_it(stack):
    s = stack(workers=0, admin_token=ADMIN)
    s.add_worker(restarts=3)  # what INFERQ_RESTARTS from the supervisor sets
    s.add_worker()  # one no supervisor started
    s.wait_ready("sim")
    with s.client() as c:

        def both() -> list[dict]:
            doc = c.get("/console/api/workers", headers=bearer(ADMIN)).json()
            return [w for w in doc["workers"] if w["live"]]

        wait_until(lambda: len(both()) == 2, 10, "both workers to advertise")
        workers = both()
        assert sorted(w["restarts"] for w in workers) == [0, 3]
        # Resident memory of the process (both run in this one): at least the interpreter's.
        assert all(w["resident_bytes"] > 10 * 2**20 for w in workers)


def test_a_redis_outage_is_a_503_with_a_message_not_a_500(stack, redis_url):
    from inferq.redisserver import free_port

    s = stack(workers=0, admin_token=ADMIN, url=f"redis://127.0.0.1:{free_port()}/0")
    with s.client() as c:
        assert c.get("/console").status_code == 200
        r = c.get("/console/api/workers", headers=bearer(ADMIN))
        assert r.status_code == 503
        assert r.json()["redis_down"] is True
        assert "Redis" in r.json()["error"]
        r = c.get("/console/api/jobs", headers=bearer(ADMIN))
        assert r.status_code == 503


@pytest.mark.serial  # watches a state that lasts one 3 s batch
def test_a_worker_shows_the_requests_it_holds_in_flight(console):
    console.wait_ready("hold")  # 3 s per batch
    with console.client() as c:
        assert c.post("/v2/models/hold/jobs", json=sim_body(1.0)).status_code == 202

        def held() -> bool:
            doc = c.get("/console/api/workers", headers=bearer(READER)).json()
            return doc["workers"][0]["in_flight"] == 1

        wait_until(held, 10, "the worker to hold the job")


def test_the_overview_warns_as_inferq_lag_does_of_an_evicting_redis(console, redis_url):
    r = redis.Redis.from_url(redis_url)
    before = r.config_get("maxmemory-policy")["maxmemory-policy"]
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with console.client() as c:

            def warned() -> bool:
                doc = c.get("/console/api/overview", headers=bearer(READER)).json()
                return any("allkeys-lru" in w for w in doc["warnings"])

            wait_until(warned, 10, "the eviction warning")
    finally:
        r.config_set("maxmemory-policy", before)


def test_the_page_loads_only_its_own_packaged_files(console):
    import re

    with console.client() as c:
        page = c.get("/console").text
        urls = re.findall(r'(?:src|href)="([^"]+)"', page)
        assert sorted(urls) == ["console/static/console.css", "console/static/console.js"]
        for url in urls:  # relative: no CDN, and it works behind a prefix
            r = c.get(f"/{url}")
            assert r.status_code == 200, url
            assert r.headers["content-type"].split(";")[0] in console_assets.values()
        assert c.get("/console/static/index.html").status_code == 404
        assert c.get("/console/static/..%2Fconsole.py").status_code == 404
        script = c.get("/console/static/console.js").text
        code = "\n".join(line for line in script.splitlines() if not line.startswith("//"))
        assert "innerHTML" not in code and "eval(" not in code and "insertAdjacentHTML" not in code
