"""The dashboard in a real browser: Debian's headless Chromium driven by Selenium against the
service (uvicorn on a free loopback port, a SQLite database in ``tmp_path``, the fake jobs
backend) holding a finished search, a running search with a measured reward and a finished
``run`` job, their events posted through the control endpoint with each job's own token.

Without the token the page is the login form and shows no data; logged in, the jobs table
has the jobs' figures, a job's page charts its search and draws its plan with that job's
numbers, and follows the job live (a new evaluation moves the chart and the best plan; the
cancel button cancels it). Screenshots go to ``build/screenshots/``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import uvicorn
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from pipeplan.core.plan import Plan
from pipeplan.service.api.app import create_app
from pipeplan.service.api.backend import ClusterState, NodeState
from pipeplan.service.api.store import Store
from tests.service.api.conftest import API_TOKEN, FakeBackend, make_settings
from tests.service.api.test_dashboard import SEARCHED, Seeded, estimate, seed_jobs

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "screenshots"
WAIT_S = 15.0
T = TypeVar("T")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
        reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}); "
        "apt-get install -y chromium chromium-driver (.ci/run does)",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Site:
    url: str
    http: httpx.Client
    backend: FakeBackend
    jobs: Seeded


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The service on a free loopback port with the seeded jobs (one per module)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    port = free_port()
    settings = make_settings(tmp, port=port)
    store = Store(settings.database_url)
    backend = FakeBackend(
        cluster=ClusterState(
            (
                NodeState(
                    "n0", "9f" * 28, True, "127.0.0.1", True, {"fast": 1.0}, {"fast": 1.0}, 1.0, 1.0
                ),
                NodeState(
                    "n1", "4c" * 28, True, "127.0.0.1", False, {"mid": 1.0}, {"mid": 0.0}, 1.0, 0.0
                ),
                NodeState(
                    "n2",
                    "d1" * 28,
                    True,
                    "127.0.0.1",
                    False,
                    {"slow": 2.0},
                    {"slow": 1.0},
                    1.0,
                    0.5,
                ),
            )
        ),
        ray_dashboard="http://127.0.0.1:8265",
    )
    app = create_app(settings, store=store, backend=backend)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    serving = threading.Thread(target=server.run, name="dashboard-server")
    serving.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and serving.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=10) as http:
            yield Site(url, http, backend, seed_jobs(http, backend))
    finally:
        server.should_exit = True
        serving.join(timeout=30)
        store.close()


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1360,1100",
        "--no-proxy-server",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def wait(driver: WebDriver, what: str, check: Callable[[WebDriver], T]) -> T:
    """``check(driver)`` once it is truthy (``what`` names it when it never is)."""
    try:
        return WebDriverWait(
            driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
        ).until(check)
    except TimeoutException:
        raise AssertionError(
            f"{what}: not seen in {WAIT_S:.0f} s at {driver.current_url}"
        ) from None


def shot(driver: WebDriver, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1360, min(max(int(height) + 40, 900), 4000))
    assert driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))
    driver.set_window_size(1360, 1100)


def fetch_status(driver: WebDriver, path: str) -> int:
    """The status the page's own ``fetch`` gets for ``path`` (its cookies, no header)."""
    script = f"const done = arguments[0]; fetch({path!r}).then(r => done(r.status));"
    return int(driver.execute_async_script(script))


def texts(driver: WebDriver, selector: str) -> list[str]:
    """The text of every element ``selector`` finds, read in one script: the live pages
    redraw their tables, so elements found one call earlier may be gone."""
    script = "return [...document.querySelectorAll(arguments[0])].map(e => e.innerText.trim())"
    return [str(t) for t in driver.execute_script(script, selector)]


def jobs_table(driver: WebDriver) -> dict[str, list[str]]:
    """The jobs table's cells by job id, newest first, read in one script."""
    script = """return [...document.querySelectorAll('#jobs-body tr[data-job-id]')].map(
        r => [r.dataset.jobId, [...r.querySelectorAll('td')].map(c => c.innerText.trim())])"""
    return {str(job): [str(c) for c in cells] for job, cells in driver.execute_script(script)}


def body_text(driver: WebDriver) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def test_the_dashboard_in_chromium(site: Site, driver: WebDriver) -> None:
    jobs = site.jobs
    ids = (jobs.finished, jobs.running, jobs.run)

    # --- without the token: the login form and no data
    for path in ("/", f"/jobs/{jobs.finished}", "/cluster"):
        driver.get(site.url + path)
        assert driver.find_element(By.ID, "login-form").is_displayed(), path
        page = body_text(driver)
        assert not any(i in page for i in ids) and "genetic search" not in page
        assert not driver.find_elements(By.ID, "jobs-body")
    assert fetch_status(driver, "/v1/jobs") == 401
    shot(driver, "login")
    driver.find_element(By.ID, "token").send_keys("not-the-token")
    driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
    assert wait(driver, "the refusal", lambda d: d.find_element(By.ID, "login-message")).text == (
        "Wrong token."
    )
    assert fetch_status(driver, "/v1/jobs") == 401

    # --- logged in: the jobs table
    driver.find_element(By.ID, "token").send_keys(API_TOKEN)
    driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
    cookie = wait(driver, "the login cookie", lambda d: d.get_cookie("pipeplan_token"))
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert driver.execute_script("return document.cookie") == ""  # HttpOnly: scripts cannot read it
    driver.get(site.url + "/")
    rows = wait(
        driver,
        "three rows",
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#jobs-body tr[data-job-id]")) == 3,
    )
    assert rows
    table = jobs_table(driver)
    assert list(table) == [jobs.run, jobs.running, jobs.finished]  # newest first
    finished = table[jobs.finished]
    assert finished[0].splitlines() == [jobs.finished, "genetic search"]
    assert finished[1:7] == ["succeeded", "plan", "tiny", "local-hetero", "genetic", "time"]
    assert finished[7] == f"{jobs.best_value_s * 1e3:.4g} ms" and finished[8] == "7"
    running = table[jobs.running]
    assert running[1:7] == ["running", "plan", "tiny", "local-hetero", "tapp", "time"]
    assert running[7:9] == [f"{jobs.running_best_s * 1e3:.4g} ms", str(jobs.running_points)]
    assert table[jobs.run][1:5] == ["succeeded", "run", "digits_cnn", "local-hetero"]
    assert table[jobs.run][7].endswith("ms measured")
    Select(driver.find_element(By.ID, "filter-state")).select_by_value("running")
    wait(
        driver,
        "the state filter",
        lambda d: texts(d, "#jobs-body tr td:nth-child(2)") == ["running"],
    )
    assert driver.current_url.endswith("/?state=running")
    Select(driver.find_element(By.ID, "filter-state")).select_by_value("")
    Select(driver.find_element(By.ID, "filter-kind")).select_by_value("run")
    wait(driver, "the kind filter", lambda d: texts(d, "#jobs-body tr td:nth-child(3)") == ["run"])
    Select(driver.find_element(By.ID, "filter-kind")).select_by_value("")
    wait(driver, "no filter", lambda d: len(texts(d, "#jobs-body tr[data-job-id]")) == 3)
    shot(driver, "jobs")

    # --- the finished search: its chart and its plan, with its numbers
    driver.get(f"{site.url}/jobs/{jobs.finished}")
    chart = wait(
        driver,
        "the chart",
        lambda d: (
            d.find_element(By.CSS_SELECTOR, "#chart canvas") and d.find_element(By.ID, "chart")
        ),
    )
    assert chart.get_attribute("data-points") == str(jobs.finished_points)
    assert chart.get_attribute("data-evaluations") == str(jobs.finished_points + 1)
    best = f"{jobs.best_value_s * 1e3:.4g} ms"
    summary = texts(driver, "#chart-summary")[0]
    assert summary.startswith(
        f"{jobs.finished_points + 1} plans evaluated (0 measured, 1 infeasible)"
    )
    assert summary.endswith(f"best {best} at evaluation {(jobs.best_seq + 1) // 2}")
    panel = wait(driver, "the plan panel", lambda d: d.find_element(By.ID, "plan-content"))
    stages = Plan.from_dict(jobs.best_plan).num_stages
    assert panel.get_attribute("data-stages") == str(stages)
    grid = driver.find_element(By.CSS_SELECTOR, "svg.plan-grid")
    assert grid.get_attribute("data-stages") == str(stages)
    assert len(grid.find_elements(By.CSS_SELECTOR, "rect.replica")) == len(
        Plan.from_dict(jobs.best_plan).devices
    )
    assert texts(driver, "#plan-value")[0] == best
    gantt = driver.find_element(By.CSS_SELECTOR, "svg.gantt")
    assert float(gantt.get_attribute("data-batch-time-ms")) == pytest.approx(
        jobs.best_value_s * 1e3, rel=1e-5
    )
    assert len(gantt.find_elements(By.CSS_SELECTOR, "rect.op")) == len(
        estimate(jobs.best_plan).timeline
    )
    assert texts(driver, "#fact-best")[0] == best
    assert "done" in wait(driver, "the log", lambda d: d.find_element(By.ID, "logs").text)
    assert not driver.find_element(By.ID, "cancel").is_displayed()
    shot(driver, "job-finished")
    driver.find_element(By.ID, "x-seconds").click()
    chart = wait(
        driver,
        "the chart over seconds",
        lambda d: d.find_element(By.CSS_SELECTOR, "#chart[data-x=seconds]"),
    )
    assert chart.find_element(By.TAG_NAME, "canvas") and chart.get_attribute("data-points") == str(
        jobs.finished_points
    )
    shot(driver, "job-finished-seconds")

    # --- the running measured search: measured beside predicted, and live
    driver.get(f"{site.url}/jobs/{jobs.running}")
    chart = wait(
        driver,
        "the measured chart",
        lambda d: (
            d.find_element(By.CSS_SELECTOR, "#chart canvas") and d.find_element(By.ID, "chart")
        ),
    )
    assert chart.get_attribute("data-measured") == str(jobs.running_points)
    assert "(3 measured, 0 infeasible)" in texts(driver, "#chart-summary")[0]
    wait(
        driver,
        "the best plan so far",
        lambda d: "best plan so far" in d.find_element(By.ID, "plan-content").text,
    )
    assert driver.find_element(By.ID, "cancel").is_displayed()
    shot(driver, "job-running")
    better = SEARCHED[3]
    # below every value the search has seen, whatever the preset's links make of the plans
    value = min(estimate(p).batch_time_s for p in SEARCHED) * 0.5
    r = site.http.post(
        f"/v1/jobs/{jobs.running}/events",
        json={
            "seq": jobs.running_next_seq,
            "type": "evaluation",
            "data": {
                "plan": better,
                "value": value,
                "source": "measured",
                "predicted_batch_time_s": value * 2,
            },
        },
        headers={"Authorization": f"Bearer {jobs.tokens[jobs.running]}"},
    )
    assert r.status_code == 200, r.text
    wait(
        driver,
        "the new point",
        lambda d: d.find_element(By.ID, "chart").get_attribute("data-points") == "4",
    )
    wait(
        driver,
        "the new best plan",
        lambda d: (
            f"event {jobs.running_next_seq}"
            in d.find_element(By.ID, "plan-content").get_attribute("data-origin")
        ),
    )
    assert texts(driver, "#plan-value")[0] == f"{value * 1e3:.4g} ms"
    driver.find_element(By.ID, "cancel").click()
    driver.switch_to.alert.accept()
    wait(driver, "the cancel", lambda d: d.find_element(By.ID, "job-state").text == "cancelled")
    assert site.backend.stopped == [jobs.running]
    assert (
        site.http.get(
            f"/v1/jobs/{jobs.running}", headers={"Authorization": f"Bearer {API_TOKEN}"}
        ).json()["state"]
        == "cancelled"
    )

    # --- the run job: measured beside predicted per stage
    driver.get(f"{site.url}/jobs/{jobs.run}")
    summary = wait(driver, "the run summary", lambda d: d.find_element(By.ID, "run-summary")).text
    assert f"{jobs.run_error:+.1%}" in summary
    assert len(driver.find_elements(By.CSS_SELECTOR, "#run-stages tbody tr")) == 2
    assert not driver.find_elements(By.ID, "search")  # a run searches nothing
    shot(driver, "job-run")

    # --- the cluster page
    driver.get(site.url + "/cluster")
    nodes = texts(driver, "#live-nodes tbody tr td:first-child")
    assert nodes == ["n0 head", "n1", "n2"]
    types = {r.split()[0]: r for r in texts(driver, "#device-types tbody tr")}
    assert "40 GFLOP/s" in types["fast"] and "$0.4 / hour" in types["fast"]
    links = [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, "#ray-links a")]
    assert "http://127.0.0.1:8265/#/jobs" in links and "http://127.0.0.1:8265/#/metrics" in links
    shot(driver, "cluster")

    # --- logged out: the login form again, and no data
    driver.find_element(By.CSS_SELECTOR, ".logout button").click()
    wait(driver, "the login form", lambda d: d.find_elements(By.ID, "login-form"))
    assert driver.get_cookie("pipeplan_token") is None
    assert jobs.finished not in body_text(driver) and fetch_status(driver, "/v1/jobs") == 401
    assert all(
        (SCREENSHOTS / f"{n}.png").stat().st_size > 10_000
        for n in ("jobs", "job-finished", "cluster")
    )
