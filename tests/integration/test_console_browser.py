"""The operator console in a real headless Chromium (Selenium with Debian's chromium-driver)
against a live ``inferq up --workers 2`` driven with traffic.

The tests share one stack and one browser, and run in order. Their screenshots go to
``$INFERQ_CONSOLE_SCREENSHOTS`` when set (``make console-screenshots`` writes docs/console/),
else to a temporary folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from inferq.redisserver import RedisServer
from protocol.keys import Keys, Lane
from protocol.messages import DeadLetter
from tests.producer.test_docs import CHROMIUM_FLAGS
from tests.support import (
    missing,
    sim_body,
    sim_request,
    stacks,
    wait_until,
    write_simulated_model,
)
from tests.upstack import UpProcess, up_processes

# serial: drives one browser through the tests in order; restarts on a freed port.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.serial]

ADMIN, READER = "console-admin-token", "console-reader-token"
HOSTILE = '<script>window.__xss=1</script>"\'><img src=x onerror="window.__xss=2">'


@pytest.fixture(scope="module")
def up(redis_server, tmp_path_factory) -> Iterator[UpProcess]:
    repo = tmp_path_factory.mktemp("console-models")
    write_simulated_model(repo, "sim", base_ms=2, per_row_ms=0, max_batch=16)
    (repo / "sim" / "2").mkdir()
    write_simulated_model(repo, "broken", base_ms=0, per_row_ms=0, max_batch=1, failure_rate=1.0)
    namespace = "console-browser"
    with up_processes(redis_server.url, namespace, repo) as start:
        u = start("--workers", "2", "--admin-token", ADMIN, "--console-token", READER)
        u.wait_ready()
        yield u
        u.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        missing("chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("selenium (pip install -e '.[dev]')")

    options = Options()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument("--window-size=1400,900")
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("INFERQ_CONSOLE_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("console-shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def until(browser: Any, condition: Any, what: str, timeout_s: float = 30) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def check(_: Any) -> Any:
        try:
            return condition()
        except (StaleElementReferenceException, WebDriverException):
            return False  # the view re-rendered under us: look again

    return WebDriverWait(browser, timeout_s, poll_frequency=0.2).until(check, what)


def text_of(browser: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return " ".join(e.text for e in browser.find_elements(By.CSS_SELECTOR, css))


def sign_in(browser: Any, up: UpProcess, token: str) -> None:
    from selenium.webdriver.common.by import By

    if not browser.current_url.startswith(f"{up.url}/console"):
        browser.get(f"{up.url}/console")
    logout = browser.find_element(By.ID, "logout")
    if logout.is_displayed():
        logout.click()
    until(browser, lambda: browser.find_element(By.ID, "token").is_displayed(), "the login form")
    field = browser.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()


def tab(browser: Any, view: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, f'#tabs button[data-view="{view}"]').click()


def cell(browser: Any, table: str, model: str, css: str) -> str:
    return text_of(browser, f'#{table} tr[data-model="{model}"] {css}')


def test_the_console_is_refused_without_a_valid_token_and_opens_with_one(up, browser, shots):
    from selenium.webdriver.common.by import By

    sign_in(browser, up, "not-the-token")
    until(browser, lambda: "refused" in text_of(browser, "#login-error"), "a refusal")
    assert not browser.find_element(By.ID, "tabs").is_displayed()
    assert httpx.get(f"{up.url}/console/api/overview", timeout=10).status_code == 401
    sign_in(browser, up, READER)
    until(browser, lambda: cell(browser, "models-overview", "sim", ".workers") == "2", "2 workers")
    assert "read-only" in text_of(browser, "#who")
    assert READER not in browser.page_source
    browser.save_screenshot(str(shots / "overview.png"))


def test_both_workers_and_the_backlog_rise_while_the_workers_are_paused(up, browser, shots):
    pids = [up.pid("worker 0"), up.pid("worker 1")]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with httpx.Client(base_url=up.url, timeout=10) as c:
            for i in range(30):
                assert c.post("/v2/models/sim/jobs", json=sim_body(float(i))).status_code == 202
        until(
            browser,
            lambda: int(cell(browser, "models-overview", "sim", ".backlog") or 0) >= 30,
            "the backlog to reach 30",
        )
        assert cell(browser, "models-overview", "sim", ".workers") == "2"
        # inferq lag's view of it: nobody reads the lane any more.
        until(browser, lambda: "backlog stalled" in text_of(browser, ".warning"), "a warning")
        browser.save_screenshot(str(shots / "backlog.png"))
        tab(browser, "workers")
        until(browser, lambda: text_of(browser, "#workers tr.live").count("sim") == 2, "workers")
        # Both advertised their memory before the pause; neither slot was restarted.
        assert text_of(browser, "#workers tr.live td.memory").count("MiB") == 2
        assert text_of(browser, "#workers tr.live td.restarts") == "0 0"
        browser.save_screenshot(str(shots / "workers.png"))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    tab(browser, "overview")
    until(browser, lambda: cell(browser, "models-overview", "sim", ".backlog") == "0", "drained")


def test_a_failed_job_is_found_through_the_filter_and_opened(up, browser, shots):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    with httpx.Client(base_url=up.url, timeout=30) as c:
        job = c.post("/v2/models/broken/jobs", json=sim_body(1.0)).json()["id"]
        assert c.get(f"/v2/jobs/{job}", params={"wait": 20}).json()["status"] == "failed"
    tab(browser, "jobs")
    until(browser, lambda: browser.find_elements(By.ID, "job-model"), "the jobs view")
    browser.find_element(By.ID, "job-model").send_keys("broken")
    Select(browser.find_element(By.ID, "job-status")).select_by_value("failed")
    browser.find_element(By.ID, "job-filter").click()
    until(browser, lambda: text_of(browser, "#jobs tbody td.status") == "failed", "the filter")
    browser.save_screenshot(str(shots / "jobs.png"))
    browser.find_element(By.CSS_SELECTOR, f'tr[data-job="{job}"] a.job-link').click()
    until(browser, lambda: "simulated failure" in text_of(browser, "#job-error"), "the job")
    assert text_of(browser, "#job-events li").split() == ["queued", "running", "failed"]
    browser.save_screenshot(str(shots / "job.png"))


def test_a_batch_shows_its_progress_counts_and_downloads(up, browser, shots):
    from selenium.webdriver.common.by import By

    good = [json.dumps(sim_body(float(v))) for v in range(3)]
    body = "\n".join([*good, '{"not": "a request"'])
    with httpx.Client(base_url=up.url, timeout=30) as c:
        batch = c.post("/v2/batches", params={"model": "sim"}, content=body).json()["id"]
        wait_until(
            lambda: c.get(f"/v2/batches/{batch}").json()["status"] == "completed",
            what="the batch to complete",
            timeout_s=60,
        )
        tab(browser, "batches")
        row = f'tr[data-batch="{batch}"]'
        until(browser, lambda: text_of(browser, f"{row} td.status") == "completed", "the batch")
        cells = [td.text for td in browser.find_elements(By.CSS_SELECTOR, f"{row} td")]
        assert cells[1:3] == ["sim", "completed"] and cells[4:6] == ["3", "1"], cells
        browser.save_screenshot(str(shots / "batches.png"))
        link = browser.find_element(By.CSS_SELECTOR, f"{row} a[download$='-output.jsonl']")
        output = c.get(link.get_attribute("href")).text.splitlines()
        assert len(output) == 3


def test_a_dead_letter_retried_from_the_console_is_answered(up, browser, shots):
    from selenium.webdriver.common.by import By

    keys = Keys(up.namespace)
    r = redis.Redis.from_url(up_redis(up))
    now_ms = int(r.time()[0]) * 1000
    # Version 2: the repository config serves the newest version only.
    request = replace(sim_request(keys, "console-retried", now_ms, value=3.0), version="2")
    reason = "the request was delivered 5 times without completing"
    r.xadd(
        keys.dlq("sim"),
        DeadLetter(keys.stream("sim", Lane.NORMAL), "1-0", reason, request.encode()).to_fields(),
    )
    sign_in(browser, up, ADMIN)
    until(browser, lambda: "admin" in text_of(browser, "#who"), "signed in as admin")
    tab(browser, "deadletters")
    until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "button.dlq-retry"), "a letter")
    browser.save_screenshot(str(shots / "deadletters.png"))
    browser.find_element(By.CSS_SELECTOR, "button.dlq-retry").click()
    until(browser, lambda: r.xlen(keys.dlq("sim")) == 0, "the letter replayed")
    up.wait_for(lambda: r.exists(keys.result("console-retried")), "the retried result", 20)
    until(browser, lambda: browser.find_elements(By.ID, "no-dead-letters"), "an empty list")


def test_switching_a_canary_split_changes_the_traffic_shares(up, browser, shots):
    from selenium.webdriver.common.by import By

    tab(browser, "overview")
    until(
        browser,
        lambda: text_of(browser, '#versions tr[data-model="sim"] .share').split() == ["100%"],
        "version 2 alone",
    )
    tab(browser, "models")
    until(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, 'input.weights[data-model="sim"]'),
        "the models view",
    )
    browser.find_element(By.CSS_SELECTOR, 'input.weights[data-model="sim"]').send_keys("1=80,2=20")
    browser.find_element(By.CSS_SELECTOR, 'div[data-model="sim"] button.split').click()
    until(
        browser,
        lambda: (
            text_of(browser, '#model-rows tr[data-model="sim"] td.num').split() == ["80%", "20%"]
        ),
        "the split applied",
        timeout_s=60,
    )
    browser.save_screenshot(str(shots / "models.png"))
    tab(browser, "overview")
    until(
        browser,
        lambda: text_of(browser, '#versions tr[data-model="sim"] .share').split() == ["80%", "20%"],
        "the overview's shares",
    )
    with httpx.Client(base_url=up.url, timeout=10) as c:
        routed = [
            c.post("/v2/models/sim/infer", json=sim_body(1.0)).json()["model_version"]
            for _ in range(200)
        ]
    assert 0.65 <= routed.count("1") / len(routed) <= 0.95  # the traffic follows the split


def test_hostile_names_payloads_and_errors_render_as_text(up, browser, shots):
    from selenium.webdriver.common.by import By

    keys = Keys(up.namespace)
    r = redis.Redis.from_url(up_redis(up))
    job_id = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    r.hset(
        keys.job(job_id),
        mapping={
            "id": job_id,
            "model": HOSTILE,
            "version": "1",
            "status": "failed",
            "created_ms": 1,
            "deadline_ms": 2,
            "error": HOSTILE,
        },
    )
    r.zadd(keys.job_index, {job_id: int(r.time()[0]) * 1000 + 60_000})
    r.xadd(keys.dlq("sim"), DeadLetter(HOSTILE, "1-0", HOSTILE, HOSTILE.encode()).to_fields())
    from selenium.webdriver.support.ui import Select

    tab(browser, "jobs")
    until(browser, lambda: browser.find_elements(By.ID, "job-model"), "the jobs view")
    browser.find_element(By.ID, "job-model").clear()
    Select(browser.find_element(By.ID, "job-status")).select_by_value("")
    browser.find_element(By.ID, "job-filter").click()
    until(browser, lambda: HOSTILE in text_of(browser, "#jobs tbody"), "the hostile job")
    tab(browser, "deadletters")
    until(browser, lambda: HOSTILE in text_of(browser, "td.preview"), "the hostile letter")
    assert HOSTILE in text_of(browser, "td.reason")
    browser.save_screenshot(str(shots / "escaped.png"))
    assert browser.execute_script("return window.__xss") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "#view img, #view script")


def up_redis(up: UpProcess) -> str:
    argv = up.proc.args
    return str(argv[argv.index("--redis") + 1])


def test_a_redis_outage_shows_as_a_banner_over_the_last_data(browser, shots, model_repo):
    from selenium.webdriver.common.by import By

    server = RedisServer().start()
    make, stop = stacks(server.url, "console-outage", model_repo)
    try:
        s = make(workers=1, models=("sim",), console_token=READER)
        browser.get(f"{s.url}/console")
        browser.find_element(By.ID, "token").send_keys(READER)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()
        until(browser, lambda: cell(browser, "models-overview", "sim", ".workers") == "1", "sim")
        server.stop()
        until(browser, lambda: "showing the last data" in text_of(browser, "#banner"), "a banner")
        assert "Redis" in text_of(browser, "#banner")
        assert cell(browser, "models-overview", "sim", ".workers") == "1"  # the last data
        browser.save_screenshot(str(shots / "outage.png"))
        server.start()
        until(browser, lambda: not browser.find_element(By.ID, "banner").is_displayed(), "clear")
    finally:
        stop()
        server.stop()
