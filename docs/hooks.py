"""MkDocs hook: pages link to files of the repository outside docs/ (bench/results/,
deploy/, examples/clusters/) with relative links, as a code host shows them; the built site
gets a copy of each such file under ``repo/``, and the links are pointed there.

- :func:`on_files` follows the links of every page in docs/ that leave docs/, adds each file
  they name (and, for a Markdown file, the files its own relative links name, and so on) to
  the site as ``repo/<path in the repository>``, outside the navigation;
- :func:`on_page_markdown` rewrites, in the pages of docs/, each link that leaves docs/ to
  that copy.

A link to a file that is not there is left as it is, so ``mkdocs build --strict`` fails on
it as on any broken link. Nothing is fetched; no plugin is needed.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "repo"
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
"""A Markdown link's target: ``](path#anchor)``; URLs are told apart by their scheme."""


def _is_url(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target)) or target.startswith("/")


def _repo_path(src_uri: str, target: str) -> str | None:
    """The repository path ``target`` names from the docs page ``src_uri``, when it leaves
    docs/; else None."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), target))
    if not joined.startswith("../") or joined.startswith("../../"):
        return None
    return joined[3:]


def _targets(text: str) -> list[str]:
    return [m.group(2) for m in LINK.finditer(text) if not _is_url(m.group(2))]


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config["docs_dir"])
    todo: list[str] = []
    for page in docs.rglob("*.md"):
        src_uri = page.relative_to(docs).as_posix()
        todo += [p for t in _targets(page.read_text()) if (p := _repo_path(src_uri, t))]
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen or not (ROOT / path).is_file():
            continue
        seen.add(path)
        abs_src = str(ROOT / path)
        not_in_nav = InclusionLevel.NOT_IN_NAV  # in the site, left out of the navigation
        files.append(
            File.generated(config, f"{PREFIX}/{path}", abs_src_path=abs_src, inclusion=not_in_nav)
        )
        if path.endswith(".md"):
            here = posixpath.dirname(path)
            for t in _targets((ROOT / path).read_text()):
                p = posixpath.normpath(posixpath.join(here, t))
                if not p.startswith("../"):
                    todo.append(p)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    src_uri = page.file.src_uri
    if src_uri.startswith(f"{PREFIX}/"):
        return markdown

    def point(m: re.Match[str]) -> str:
        target = m.group(2)
        path = None if _is_url(target) else _repo_path(src_uri, target)
        if path is None or not (ROOT / path).is_file():
            return m.group(0)
        rel = posixpath.relpath(f"{PREFIX}/{path}", posixpath.dirname(src_uri) or ".")
        return f"{m.group(1)}{rel}{m.group(3)}"

    return LINK.sub(point, markdown)
