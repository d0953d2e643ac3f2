"""The dashboard (service/web, service/api/routes/dashboard.py) in process: no data without a
login, the login cookie (HttpOnly, SameSite=Strict) that the JSON API takes in place of the
header, CSRF on a cookie's cancel, the plan panel (best plan, stages x devices, Gantt chart
from the cost model, a run's measured beside predicted stage times), the cluster page, and
the SVG and Ray-dashboard readers behind them.

:func:`seed_jobs` posts the jobs the browser test (tests/service/test_browser.py) shows too.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.worker_pool import Outcome, resolve
from pipeplan.service.api.app import create_app
from pipeplan.service.api.auth import COOKIE, CSRF_HEADER
from pipeplan.service.api.backend import (
    BackendState,
    BackendStatus,
    ClusterState,
    NodeState,
    Submission,
)
from pipeplan.service.api.pool import PROFILE_TARGET, PlannerPool
from pipeplan.service.api.ray_jobs import RayJobsBackend, nodes_from_dashboard
from pipeplan.service.api.routes.dashboard import local_path
from pipeplan.service.api.schemas import JobKind
from pipeplan.service.api.settings import Settings
from pipeplan.service.api.store import Store
from pipeplan.service.tasks.common import cluster_spec, zoo_profile
from pipeplan.service.tasks.progress import QUIET
from pipeplan.service.web import plan_view
from pipeplan.service.web.plan_view import gantt_svg, plan_grid_svg
from pipeplan.service.web.run_view import comparison_of, stage_bars_svg
from pipeplan.service.web.svg import nice_ticks
from tests.core.test_formats import PROFILE
from tests.service.api.conftest import API_TOKEN, AUTH, FakeBackend
from tests.service.test_pool import FakeWorkers

Doc = dict[str, Any]
CLUSTER_NAME = "local-hetero"
LOGIN_FORM = '<form method="post" action="/login" id="login-form">'


# --- the jobs the dashboard tests (and the browser test) show --------------------------------


def plan_doc(*stages: tuple[tuple[int, int], list[str], int], batch: int = 8) -> Doc:
    return {
        "global_batch": batch,
        "stages": [{"layers": list(lay), "devices": d, "microbatch": m} for lay, d, m in stages],
    }


FAST, MID, SLOW0, SLOW1 = "n0/fast:0", "n1/mid:0", "n2/slow:0", "n2/slow:1"
SEARCHED = [
    plan_doc(((0, 2), [FAST], 4), ((2, 3), [MID], 4)),
    plan_doc(((0, 1), [FAST], 2), ((1, 2), [MID], 2), ((2, 3), [SLOW0], 2)),
    plan_doc(((0, 2), [FAST], 2), ((2, 3), [MID], 2)),
    plan_doc(((0, 1), [FAST], 4), ((1, 3), [SLOW0, SLOW1], 4)),
    plan_doc(((0, 1), [MID], 4), ((1, 3), [SLOW0, SLOW1], 4)),
    plan_doc(((0, 2), [SLOW0], 8), ((2, 3), [SLOW1], 8)),
]
"""The plans the finished search valued, in order (which is best depends on the preset's links)."""
MEASURED_ERRORS = [0.20, -0.10, 0.05]
"""(measured - predicted) / predicted of the running measured search's runs."""


RUN_PLAN = plan_doc(((0, 4), [FAST], 4), ((4, 8), [SLOW0, SLOW1], 4))
"""The plan the ``run`` job runs: digits_cnn's 8 layers in 2 stages."""


@functools.cache
def digits_profile() -> Doc:
    """digits_cnn's analytic profile (a run job names a zoo model the executor can build)."""
    return zoo_profile("digits_cnn", None, QUIET).to_dict()


def estimate(plan: Doc, profile: Doc = PROFILE) -> Estimate:
    prof = ModelProfile.from_dict(profile)
    return simulate(Plan.from_dict(plan), prof, cluster_spec(CLUSTER_NAME))


@dataclass
class Seeded:
    """The jobs :func:`seed_jobs` made: ids and what the pages must show of them."""

    finished: str
    running: str
    run: str
    best_value_s: float
    best_seq: int
    best_plan: Doc
    finished_points: int
    running_points: int
    running_best_s: float
    running_next_seq: int
    """The seq of the running job's next event."""
    run_error: float
    tokens: dict[str, str] = field(default_factory=dict)


def post_events(http: httpx.Client, job_id: str, token: str, events: list[Doc]) -> None:
    """Post ``events`` (``seq`` 0, 1, ...) through the control endpoint, as the job does."""
    for seq, (type_, data) in enumerate((e["type"], e["data"]) for e in events):
        r = http.post(
            f"/v1/jobs/{job_id}/events",
            json={"seq": seq, "type": type_, "data": data},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200, r.text


def _submit(http: httpx.Client, kind: str, spec: Doc, name: str) -> str:
    r = http.post("/v1/jobs", json={"kind": kind, "spec": spec, "name": name}, headers=AUTH)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def run_result(plan: Doc, factor: float) -> Doc:
    """A ``run`` job's result document (what ``pipeplan run --json`` prints) of ``plan`` on
    digits_cnn, whose measured times are the prediction's x ``factor``."""
    est = estimate(plan, digits_profile())
    stages = [
        {
            "index": s.index,
            "layers": list(s.layers),
            "devices": list(s.devices),
            "microbatch": s.microbatch,
            "forward_s": s.forward_s * s.microbatches * factor,
            "backward_s": s.backward_s * s.microbatches * factor,
            "update_s": (s.update_s + s.allreduce_s) * factor,
            "compute_s": s.compute_s * factor,
            "transfer_s": s.transfer_s * factor,
            "wait_s": 0.0,
            "emulated_s": 0.0,
        }
        for s in est.stages
    ]
    measured = {
        "plan": plan,
        "batch_time_s": est.batch_time_s * factor,
        "batch_time_std_s": est.batch_time_s * 0.02,
        "stages": stages,
        "emulated": True,
    }
    return {
        "model": "digits_cnn",
        "cluster": CLUSTER_NAME,
        "profile": "profile 'digits_cnn' given",
        "emulated": True,
        "plan": plan,
        "predicted": est.to_dict(),
        "measured": measured,
        "error": {"batch_time": 1 / factor - 1},
    }


def seed_jobs(http: httpx.Client, backend: FakeBackend) -> Seeded:
    """Three jobs through the API and the control endpoint: a finished ``plan`` search (six
    simulated evaluations and a plan none could run), a running search with a measured
    reward (three runs, each with its prediction) and a finished ``run`` job."""
    common = {"profile": PROFILE, "cluster": CLUSTER_NAME, "batch": 8}
    finished = _submit(http, "plan", {**common, "planner": "genetic"}, "genetic search")
    running = _submit(
        http, "plan", {**common, "planner": "tapp", "reward": "measured"}, "measured search"
    )
    values = [estimate(p).batch_time_s for p in SEARCHED]
    best = min(range(len(values)), key=values.__getitem__)
    events: list[Doc] = [{"type": "progress", "data": {"evaluations": 0, "best_value": None}}]
    for i, (plan, value) in enumerate(zip(SEARCHED, values, strict=True)):
        data = {"plan": plan, "value": value, "batch_time_s": value, "source": "simulated"}
        events.append({"type": "evaluation", "data": data})
        best_so_far = min(values[: i + 1])
        events.append(
            {"type": "progress", "data": {"evaluations": i + 1, "best_value": best_so_far}}
        )
    events.append(
        {"type": "evaluation", "data": {"plan": SEARCHED[0], "value": None, "source": "simulated"}}
    )
    result = {
        "plan": SEARCHED[best],
        "estimate": estimate(SEARCHED[best]).to_dict(),
        "planner": "genetic",
        "evaluations": len(SEARCHED) + 1,
        "wall_time_s": 1.5,
    }
    events.append({"type": "result", "data": result})
    tokens = {j: backend.token_of(j) for j in (finished, running)}
    post_events(http, finished, tokens[finished], events)
    backend.log_text[finished] = "\n".join(
        ["search genetic (budget 7 evaluations)", *[f"evaluation {i}" for i in range(7)], "done"]
    )

    runs: list[Doc] = [{"type": "progress", "data": {"evaluations": 0, "best_value": None}}]
    measured_values: list[float] = []
    for plan, error in zip(SEARCHED[:3], MEASURED_ERRORS, strict=True):
        predicted = estimate(plan).batch_time_s
        measured_values.append(predicted * (1 + error))
        data = {
            "plan": plan,
            "value": measured_values[-1],
            "batch_time_s": measured_values[-1],
            "predicted_batch_time_s": predicted,
            "source": "measured",
        }
        runs.append({"type": "evaluation", "data": data})
        progress = {"evaluations": len(measured_values), "best_value": min(measured_values)}
        runs.append({"type": "progress", "data": progress})
    post_events(http, running, tokens[running], runs)
    backend.statuses[running] = BackendStatus(BackendState.RUNNING)
    backend.log_text[running] = "measuring plan 1 ...\nmeasuring plan 2 ...\nmeasuring plan 3 ..."

    run_spec = {"plan": RUN_PLAN, "profile": digits_profile(), "cluster": CLUSTER_NAME}
    run = _submit(http, "run", run_spec, "run of the plan")
    tokens[run] = backend.token_of(run)
    post_events(http, run, tokens[run], [{"type": "result", "data": run_result(RUN_PLAN, 1.25)}])
    return Seeded(
        finished=finished,
        running=running,
        run=run,
        best_value_s=values[best],
        best_seq=2 * best + 1,
        best_plan=SEARCHED[best],
        finished_points=len(SEARCHED),
        running_points=len(MEASURED_ERRORS),
        running_best_s=min(measured_values),
        running_next_seq=len(runs),
        run_error=1 / 1.25 - 1,
        tokens=tokens,
    )


# --- fixtures ---------------------------------------------------------------------------------


def login(client: TestClient) -> None:
    r = client.post("/login", data={"token": API_TOKEN, "next": "/"}, follow_redirects=False)
    assert r.status_code == 303, r.text


@pytest.fixture
def seeded(anon_client: TestClient, fake_backend: FakeBackend) -> Seeded:
    return seed_jobs(anon_client, fake_backend)


@pytest.fixture
def browser(app: FastAPI) -> Iterator[TestClient]:
    """A client of the app that logs in with the form (no Authorization header)."""
    with TestClient(app) as client:
        login(client)
        yield client


# --- no data without a login ----------------------------------------------------------------


def test_without_a_login_every_page_is_the_login_form_and_no_data(
    anon_client: TestClient, seeded: Seeded
) -> None:
    for path in ("/", f"/jobs/{seeded.finished}", "/cluster", "/?state=running"):
        r = anon_client.get(path)
        assert r.status_code == 401 and LOGIN_FORM in r.text, path
        assert "genetic search" not in r.text and "jobs-body" not in r.text
        assert "live-nodes" not in r.text and "device-types" not in r.text
    for path in (f"/jobs/{seeded.finished}/plan", "/cluster/nodes"):
        r = anon_client.get(path)
        assert r.status_code == 401 and "svg" not in r.text and "Not logged in" in r.text
    for path in ("/v1/jobs", f"/v1/jobs/{seeded.finished}/events"):
        assert anon_client.get(path).status_code == 401
    assert anon_client.get("/static/dashboard.js").status_code == 200  # no data in there


def test_the_login_sets_an_httponly_strict_cookie_and_the_logout_clears_it(
    anon_client: TestClient, seeded: Seeded
) -> None:
    r = anon_client.post(
        "/login",
        data={"token": API_TOKEN, "next": f"/jobs/{seeded.finished}"},
        follow_redirects=False,
    )
    assert r.status_code == 303 and r.headers["location"] == f"/jobs/{seeded.finished}"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={API_TOKEN};")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie  # plain http on loopback: a Secure cookie would not be sent
    page = anon_client.get("/")
    assert page.status_code == 200 and 'id="jobs-body"' in page.text and LOGIN_FORM not in page.text
    job_page = anon_client.get(f"/jobs/{seeded.finished}")
    assert job_page.status_code == 200 and 'data-job-id="' + seeded.finished in job_page.text
    assert anon_client.get("/v1/jobs").json()["items"]  # the JSON API takes the cookie
    r = anon_client.post("/logout", follow_redirects=False)
    assert r.status_code == 303 and f'{COOKIE}=""' in r.headers["set-cookie"]
    assert "Max-Age=0" in r.headers["set-cookie"]
    assert anon_client.get("/").status_code == 401
    assert anon_client.get("/v1/jobs").status_code == 401


def test_a_wrong_token_is_refused_and_the_login_never_leaves_the_site(
    anon_client: TestClient,
) -> None:
    r = anon_client.post("/login", data={"token": "nope", "next": "/cluster"})
    assert r.status_code == 403 and "Wrong token." in r.text and LOGIN_FORM in r.text
    assert 'value="/cluster"' in r.text and "set-cookie" not in r.headers
    for target, expected in [
        ("//evil.example/x", "/"),
        ("https://evil.example/", "/"),
        ("/\\evil.example", "/"),
        ("jobs", "/"),
        ("", "/"),
        ("/jobs/pp-1?x=1", "/jobs/pp-1?x=1"),
    ]:
        assert local_path(target) == expected, target
        r = anon_client.post(
            "/login", data={"token": API_TOKEN, "next": target}, follow_redirects=False
        )
        assert r.headers["location"] == expected
    r = anon_client.post("/login", json={"token": API_TOKEN})
    assert r.status_code == 400 and "content-type: expected a form" in r.text
    r = anon_client.post(
        "/login",
        content=b"token=" + b"x" * 5000,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 400 and "body: over 4096 bytes" in r.text


def test_a_stale_cookie_shows_the_login_form_and_is_cleared(anon_client: TestClient) -> None:
    anon_client.cookies.set(COOKIE, "an-old-token")
    r = anon_client.get("/")
    assert r.status_code == 401 and "no longer valid" in r.text
    assert f'{COOKIE}=""' in r.headers["set-cookie"]


# --- the cookie in the JSON API --------------------------------------------------------------


def test_the_api_takes_the_cookie_where_no_header_is_sent_and_the_header_rules_stand(
    anon_client: TestClient, seeded: Seeded
) -> None:
    anon_client.cookies.set(COOKIE, API_TOKEN)
    assert anon_client.get("/v1/jobs").status_code == 200
    assert anon_client.get(f"/v1/jobs/{seeded.finished}").json()["state"] == "succeeded"
    assert anon_client.get(f"/v1/jobs/{seeded.finished}/logs").text.endswith("done")
    wrong = anon_client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json() == {"detail": "Authorization: unknown token"}
    anon_client.cookies.set(COOKIE, "nope")
    r = anon_client.get("/v1/jobs")
    assert r.status_code == 401 and r.json() == {"detail": "Authorization: unknown token"}
    assert anon_client.get("/v1/jobs", headers=AUTH).status_code == 200  # the header counts
    job_token = {"Authorization": f"Bearer {seeded.tokens[seeded.running]}"}
    assert anon_client.get(f"/v1/jobs/{seeded.running}", headers=job_token).status_code == 200


def test_a_cancel_by_the_cookie_needs_the_csrf_header(
    anon_client: TestClient, seeded: Seeded, fake_backend: FakeBackend
) -> None:
    anon_client.cookies.set(COOKIE, API_TOKEN)
    url = f"/v1/jobs/{seeded.running}/cancel"
    r = anon_client.post(url)
    assert r.status_code == 403 and r.json()["detail"].startswith(f"{CSRF_HEADER}: missing")
    r = anon_client.post(url, headers={CSRF_HEADER: "yes"})
    assert r.status_code == 403 and fake_backend.stopped == []
    r = anon_client.post(url, headers={CSRF_HEADER: "1"})
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert fake_backend.stopped == [seeded.running]
    anon_client.cookies.clear()
    r = anon_client.post(f"/v1/jobs/{seeded.finished}/cancel", headers=AUTH)
    assert r.status_code == 409  # with the header, no CSRF header is asked for


# --- the pages -------------------------------------------------------------------------------


def test_the_pages_are_html_kept_out_of_openapi_and_framed_nowhere(
    browser: TestClient, seeded: Seeded
) -> None:
    for path in ("/", f"/jobs/{seeded.finished}", "/cluster", f"/jobs/{seeded.run}/plan"):
        r = browser.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
        assert "<script>" not in r.text  # no inline script: the policy allows none
    paths = browser.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if not p.startswith(("/v1/", "/healthz", "/readyz", "/metrics"))]
    page = browser.get("/?state=running&kind=plan").text
    assert '<option value="running" selected>' in page and '<option value="plan" selected>' in page
    r = browser.get("/?state=sleeping")
    assert (
        r.status_code == 422 and "state" in r.json()["detail"] and "sleeping" in r.json()["detail"]
    )
    r = browser.get("/jobs/pp-nosuchjob")
    assert r.status_code == 404 and "no such job" in r.text


def _number(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found, pattern
    return found.group(1)


def test_the_plan_panel_draws_the_best_plan_and_its_gantt_chart_from_the_cost_model(
    browser: TestClient, seeded: Seeded
) -> None:
    panel = browser.get(f"/jobs/{seeded.running}/plan?seq=1").text
    est = estimate(SEARCHED[0])
    assert 'data-stages="2"' in panel
    assert "the best plan so far (event 1, measured)" in panel.lower()
    assert panel.count("class='replica'") == 2
    assert float(_number(r"data-batch-time-ms='([0-9.e+-]+)'", panel)) == pytest.approx(
        est.batch_time_s * 1e3, rel=1e-5
    )
    assert panel.count("class='op op-") == len(est.timeline)
    final = browser.get(f"/jobs/{seeded.finished}/plan").text
    assert "the plan genetic found" in final.lower() and 'data-stages="2"' in final
    assert f"{seeded.best_value_s * 1e3:.4g} ms" in final
    assert final.count("class='replica'") == len(Plan.from_dict(seeded.best_plan).devices)
    no_plan = browser.get(f"/jobs/{seeded.finished}/plan?seq=0").text  # a progress event
    assert "the plan genetic found" in no_plan.lower()


def test_a_running_search_without_evaluations_says_so(
    browser: TestClient, fake_backend: FakeBackend
) -> None:
    job = browser.post(
        "/v1/jobs",
        json={
            "kind": "plan",
            "spec": {"profile": PROFILE, "cluster": CLUSTER_NAME, "planner": "dp"},
        },
        headers=AUTH,
    ).json()
    panel = browser.get(f"/jobs/{job['id']}/plan").text
    assert "no plan yet" in panel and 'data-stages="0"' in panel


def test_the_plan_panel_says_which_stages_recompute(
    browser: TestClient, fake_backend: FakeBackend
) -> None:
    spec = {"profile": PROFILE, "cluster": CLUSTER_NAME, "planners": ["dp"]}
    job = browser.post("/v1/jobs", json={"kind": "compare", "spec": spec}, headers=AUTH).json()
    plan = copy.deepcopy(SEARCHED[5])
    plan["stages"][1]["recompute"] = True
    rows = [{"planner": "dp", "ok": True, "value": 0.01, "plan": plan}]
    result = {"best": "dp", "results": rows, "objective": "time"}
    post_events(browser, job["id"], fake_backend.token_of(job["id"]), [
        {"type": "result", "data": result}
    ])  # fmt: skip
    panel = browser.get(f"/jobs/{job['id']}/plan").text
    cells = re.findall(r'<td class="num">(\d+ × \d+[^<]*)</td>', panel)
    assert [", recompute" in c for c in cells] == [False, True], cells


def test_a_comparison_shows_its_best_rows_plan_and_a_profile_job_none(
    browser: TestClient, fake_backend: FakeBackend
) -> None:
    spec = {"profile": PROFILE, "cluster": CLUSTER_NAME, "planners": ["dp", "greedy"]}
    r = browser.post("/v1/jobs", json={"kind": "compare", "spec": spec}, headers=AUTH)
    job = r.json()["id"]
    rows = [
        {"planner": "dp", "ok": True, "value": 0.01, "plan": SEARCHED[5]},
        {"planner": "greedy", "ok": True, "value": 0.03, "plan": SEARCHED[0]},
    ]
    result = {"best": "dp", "results": rows, "objective": "time"}
    post_events(browser, job, fake_backend.token_of(job), [{"type": "result", "data": result}])
    panel = browser.get(f"/jobs/{job}/plan").text
    assert "the best plan of the comparison (dp)" in panel.lower() and "10 ms" in panel
    assert panel.count("class='replica'") == 2
    r = browser.post(
        "/v1/jobs", json={"kind": "profile", "spec": {"model": "digits_cnn"}}, headers=AUTH
    )
    assert r.status_code == 201, r.text
    panel = browser.get(f"/jobs/{r.json()['id']}/plan").text
    assert "a profile job makes no plan" in panel and "<svg" not in panel


def test_a_run_job_shows_measured_beside_predicted_per_stage(
    browser: TestClient, seeded: Seeded
) -> None:
    panel = browser.get(f"/jobs/{seeded.run}/plan").text
    assert "the plan this job runs" in panel.lower() and "EMULATED" in panel
    assert f"{seeded.run_error:+.1%}" in panel
    assert panel.count("class='measured'") == 2 * 3 and panel.count("class='predicted'") == 2 * 3
    assert panel.count("-20.0%") >= 3 * 2  # each stage's compute, transfer (and update)


def test_a_run_without_a_profile_says_why_there_is_no_gantt_chart(
    browser: TestClient, fake_backend: FakeBackend
) -> None:
    spec = {"plan": RUN_PLAN, "model": "digits_cnn", "cluster": CLUSTER_NAME}
    r = browser.post("/v1/jobs", json={"kind": "run", "spec": spec}, headers=AUTH)
    assert r.status_code == 201, r.text
    panel = browser.get(f"/jobs/{r.json()['id']}/plan").text
    assert "a profile measured on the cluster" in panel and "no Gantt chart" in panel
    assert "class='gantt'" not in panel and 'data-stages="2"' in panel


TRAIN_SPEC: Doc = {"plan": RUN_PLAN, "model": "digits_cnn", "cluster": CLUSTER_NAME}
"""A train job of a zoo model without a profile: its panel costs the plan with the model's
analytic profile, which only the planner pool takes (the API process has no torch)."""


def _zoo_panel(client: TestClient) -> str:
    r = client.post("/v1/jobs", json={"kind": "train", "spec": TRAIN_SPEC}, headers=AUTH)
    assert r.status_code == 201, r.text
    return client.get(f"/jobs/{r.json()['id']}/plan").text


def _pool_app(
    api_settings: Settings, store: Store, backend: FakeBackend, answer: Callable[..., Outcome]
) -> tuple[FastAPI, list[str]]:
    """An app whose planner pool runs each call in the test's process, as ``answer`` does."""
    calls: list[str] = []

    def script(worker: Any, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        calls.append(target)
        return answer(target, args)

    pool = PlannerPool(FakeWorkers(script), size=1)
    return create_app(api_settings, store=store, backend=backend, pool=pool), calls


def test_a_zoo_models_plan_is_costed_with_the_profile_the_pool_takes(
    api_settings: Settings, store: Store, fake_backend: FakeBackend
) -> None:
    app, calls = _pool_app(
        api_settings, store, fake_backend, lambda t, a: Outcome(value=resolve(t)(*a))
    )
    with TestClient(app) as client:
        login(client)
        panel = _zoo_panel(client)
        again = _zoo_panel(client)
    est = estimate(RUN_PLAN, digits_profile())
    assert panel.count("class='op op-") == len(est.timeline) > 0
    assert float(_number(r"data-batch-time-ms='([0-9.e+-]+)'", panel)) == pytest.approx(
        est.batch_time_s * 1e3, rel=1e-5
    )
    assert again.count("class='op op-") == len(est.timeline)
    assert calls == [PROFILE_TARGET]  # taken once, then kept


def test_a_profile_the_pool_cannot_take_is_said_in_the_panel(
    api_settings: Settings, store: Store, fake_backend: FakeBackend
) -> None:
    app, _ = _pool_app(api_settings, store, fake_backend, lambda t, a: Outcome(error="no room"))
    with TestClient(app) as client:
        login(client)
        panel = _zoo_panel(client)
    assert "profiling digits_cnn: no room" in panel and "class='gantt'" not in panel


def test_without_a_pool_a_zoo_models_panel_says_why_there_is_no_gantt_chart(
    browser: TestClient,
) -> None:
    panel = _zoo_panel(browser)
    assert "runs without a pool: no Gantt chart" in panel and "class='gantt'" not in panel
    assert 'data-stages="2"' in panel


# --- the cluster page ------------------------------------------------------------------------


NODES = (
    NodeState("n0", "a" * 56, True, "127.0.0.1", True, {"fast": 1.0}, {"fast": 1.0}, 1.0, 1.0),
    NodeState("n1", "b" * 56, True, "127.0.0.1", False, {"mid": 1.0}, {"mid": 0.0}, 1.0, 0.0),
    NodeState("n2", "c" * 56, False, "127.0.0.1", False, {"slow": 2.0}, None, 1.0, None),
)


def test_the_cluster_page_shows_device_types_live_nodes_what_is_in_use_and_ray_links(
    browser: TestClient, fake_backend: FakeBackend
) -> None:
    page = browser.get("/cluster").text
    assert "40 GFLOP/s" in page and "$0.4 / hour" in page and "4 GB" in page
    assert "None: the cluster reports no live node." in page and "ray-links" in page
    assert "No Ray dashboard" in page
    fake_backend.cluster = ClusterState(NODES)
    fake_backend.ray_dashboard = "http://127.0.0.1:8265"
    page = browser.get("/cluster").text
    for label in ("jobs", "actors", "metrics"):
        assert f'href="http://127.0.0.1:8265/#/{label}"' in page
    live = browser.get("/cluster/nodes").text
    rows = re.findall(r"<tr><td>(n\d)", live)
    assert rows == ["n0", "n1"] and "1 dead node not shown" in live
    assert re.search(r"device:fast</code>\s*1 / 1", live) and re.search(
        r"device:mid</code>\s*0 / 1", live
    )
    fake_backend.cluster = ClusterState(error="Ray dashboard at http://x: ConnectError: refused")
    assert "ConnectError: refused" in browser.get("/cluster/nodes").text


@dataclass
class NoClusterBackend:
    """A jobs backend that cannot describe its cluster (not a ClusterSource)."""

    def submit(self, submission: Submission) -> str:
        return submission.job_id

    def stop(self, job_id: str) -> None:
        return None

    def status(self, job_id: str) -> BackendStatus:
        return BackendStatus(BackendState.RUNNING)

    def logs(self, job_id: str) -> str:
        return ""

    def ready(self) -> str | None:
        return None


def test_a_backend_that_cannot_describe_its_cluster_shows_none(
    api_settings: Settings, store: Store
) -> None:
    with TestClient(create_app(api_settings, store=store, backend=NoClusterBackend())) as client:
        login(client)
        page = client.get("/cluster").text
    assert "does not run on a Ray cluster it can describe" in page and "No Ray dashboard" in page


# --- what is behind the pages ----------------------------------------------------------------

NODES_DOC: Doc = {  # Ray 2.60's /api/v0/nodes, trimmed
    "result": True,
    "data": {
        "result": {
            "total": 3,
            "result": [
                {
                    "node_id": "b9b7b09cc8a3",
                    "node_ip": "127.0.0.1",
                    "is_head_node": False,
                    "state": "ALIVE",
                    "resources_total": {"CPU": 1.0, "device:mid": 1.0, "pipeplan_node:n1": 1.0},
                },
                {
                    "node_id": "fad154a32c95",
                    "node_ip": "127.0.0.1",
                    "is_head_node": True,
                    "state": "ALIVE",
                    "resources_total": {
                        "CPU": 2.0,
                        "device:cpu_fast": 2.0,
                        "pipeplan_node:n0": 1.0,
                    },
                },
                {"node_id": "0123456789ab", "state": "DEAD", "resources_total": {"CPU": 1.0}},
            ],
        }
    },
}
STATUS_DOC: Doc = {  # Ray 2.60's /api/cluster_status: keys camel-cased by the dashboard
    "data": {
        "clusterStatus": {
            "loadMetricsReport": {
                "usageByNode": {
                    "fad154a32c95": {"CPU": [1.0, 2.0], "device:cpuFast": [1.0, 2.0]},
                    "b9b7b09cc8a3": {"CPU": [0.0, 1.0], "device:mid": [0.0, 1.0]},
                }
            }
        }
    }
}


def test_the_nodes_are_read_off_rays_dashboard_answers() -> None:
    nodes = nodes_from_dashboard(NODES_DOC, STATUS_DOC)
    assert [(n.name, n.alive, n.head) for n in nodes] == [
        ("n0", True, True),
        ("n1", True, False),
        ("node-01234567", False, False),
    ]
    assert nodes[0].devices == {"cpu_fast": 2.0} and nodes[0].devices_in_use == {"cpu_fast": 1.0}
    assert nodes[0].cpus == 2.0 and nodes[0].cpus_in_use == 1.0
    assert nodes[1].devices_in_use == {"mid": 0.0} and nodes[2].devices_in_use is None
    unknown = nodes_from_dashboard(NODES_DOC, None)
    assert all(n.devices_in_use is None and n.cpus_in_use is None for n in unknown)


@pytest.mark.timeout(30)
def test_an_unreachable_ray_dashboard_is_named_not_raised() -> None:
    backend = RayJobsBackend("http://127.0.0.1:1", token="t")
    state = backend.cluster_state()
    assert state.nodes == () and state.error is not None
    assert state.error.startswith("Ray dashboard at http://127.0.0.1:1: ConnectError")
    assert backend.dashboard_url() == "http://127.0.0.1:1"


def test_the_plan_grid_has_a_cell_per_replica_and_a_column_per_device() -> None:
    plan = Plan.from_dict(SEARCHED[3])
    svg = plan_grid_svg(plan, cluster_spec(CLUSTER_NAME))
    assert "data-stages='2'" in svg and "data-devices='3'" in svg
    assert svg.count("class='replica'") == 3 and svg.count("<title>") == 3
    assert all(f">{d}</text>" in svg for d in ("fast:0", "mid:0", "slow:0", "slow:1"))
    alone = plan_grid_svg(plan)  # without a cluster: the plan's own devices only
    assert ">mid:0</text>" not in alone and alone.count("class='replica'") == 3


def test_the_plan_grid_names_each_replicas_share_as_the_executor_cuts_it() -> None:
    """Rule 2i: a microbatch of 5 on two replicas is 3 samples on the first, 2 on the second."""
    plan = Plan.from_dict(
        {
            "global_batch": 10,
            "stages": [{"layers": [0, 2], "devices": ["n2/slow:0", "n2/slow:1"], "microbatch": 5}],
        }
    )
    svg = plan_grid_svg(plan)
    assert "on n2/slow:0: layers [0, 2), 3 samples of each microbatch of 5" in svg
    assert "on n2/slow:1: layers [0, 2), 2 samples of each microbatch of 5" in svg


def test_the_gantt_chart_draws_every_box_of_the_timeline_or_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    est = estimate(SEARCHED[1])
    svg = gantt_svg(est)
    assert svg is not None and svg.count("class='op op-") == len(est.timeline)
    kinds = {e.kind for e in est.timeline}
    assert {"F", "B", "send", "grad", "update"} <= kinds
    assert all(f"class='op op-{k}'" in svg for k in kinds)
    monkeypatch.setattr(plan_view, "MAX_GANTT_EVENTS", len(est.timeline) - 1)
    assert gantt_svg(est) is None


def test_a_run_result_becomes_stage_rows_with_their_errors() -> None:
    result = run_result(RUN_PLAN, 2.0)
    from_run = comparison_of(JobKind.RUN, result)
    assert from_run is not None and from_run.emulated and len(from_run.stages) == 2
    assert from_run.error == pytest.approx(-0.5)
    assert from_run.stages[1].error("compute") == pytest.approx(-0.5)
    assert "data-stages='2'" in stage_bars_svg(from_run)
    measured_search = {"estimate": result["predicted"], "measured": {"best": result["measured"]}}
    assert comparison_of(JobKind.PLAN, measured_search) is not None
    assert comparison_of(JobKind.PLAN, {"estimate": result["predicted"]}) is None
    assert comparison_of(JobKind.RUN, None) is None


def test_nice_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(9.3) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0.07) == pytest.approx([0, 0.02, 0.04, 0.06, 0.08])
    assert nice_ticks(0) == [0.0] and nice_ticks(math.inf) == [0.0]
