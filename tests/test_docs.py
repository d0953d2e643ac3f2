"""The documentation: the generated parts are what the code writes now, and the README stays
a front page.

- ``docs/openapi.json`` is the app's ``app.openapi()`` (the app built as the API's tests build
  it), and the routes table of ``docs/api.md`` is what ``docs/gen_api.py`` writes from it;
- ``docs/cli.md`` is what ``docs/gen_cli.py`` writes from the typer app now (slow: it imports
  every command's module in a fresh interpreter);
- README.md has at most 200 lines, and every relative link of README.md and of the pages
  under docs/ names a file of the repository (nothing outside it, such as ``../shared``).

No Ray, no server: ``make docs`` builds the site itself.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from pipeplan.service.api.app import create_app
from pipeplan.service.api.store import Store
from tests.service.api.conftest import FakeBackend, make_settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _app_openapi(tmp_path: Path) -> dict:
    settings = make_settings(tmp_path)
    store = Store(settings.database_url)
    try:
        return create_app(settings, store=store, backend=FakeBackend()).openapi()
    finally:
        store.close()


def test_openapi_json_is_the_apps(tmp_path: Path) -> None:
    doc = _app_openapi(tmp_path)
    committed = json.loads((DOCS / "openapi.json").read_text())
    assert committed == doc, "docs/openapi.json is out of date: run make docs"


def test_api_page_lists_the_apps_routes(tmp_path: Path) -> None:
    doc = _app_openapi(tmp_path)
    gen = _load("gen_api")
    page = (DOCS / "api.md").read_text()
    assert gen.page_text(page, doc) == page, "docs/api.md's routes are out of date: make docs"
    for path, ops in doc["paths"].items():
        for method in ops:
            assert f"`{method.upper()} {path}`" in page


@pytest.mark.slow
def test_cli_page_is_what_the_generator_writes() -> None:
    gen = _load("gen_cli")
    assert (DOCS / "cli.md").read_text() == gen.render(), "docs/cli.md: run make docs"


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert "../shared" not in README.read_text()


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not links
    return [
        t.split("#")[0]
        for t in LINK.findall(text)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")
    ]


@pytest.mark.parametrize(
    "page",
    [README, *sorted(DOCS.rglob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_name_files_of_the_repository(page: Path) -> None:
    for target in _relative_links(page):
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{page.name}: {target} points outside the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"
