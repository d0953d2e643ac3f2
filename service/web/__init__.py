"""The dashboard (``GET /``): jobs, a job's search and plan, the cluster.

Pages are rendered on the server from the Jinja2 templates in ``templates/``; their live
parts are drawn in the browser by small hand-written scripts in ``static/`` that poll the
JSON API (with the login cookie) and chart the search with the vendored uPlot. The plan
(stages x devices), its Gantt chart from the cost model's timeline and a run's measured
beside predicted stage times are SVG drawn here (:mod:`service.web.plan_view`,
:mod:`service.web.run_view`). Nothing is fetched from the internet and nothing is built.
"""

from __future__ import annotations

from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"
