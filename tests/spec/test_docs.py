"""The repository explains itself: the configuration table of docs/configuration.md is the
configuration, the documents, links and sections that code and docs cite exist, every shell block
of the README and docs/ is run by a test or marked as not run here, and ``server/`` reaches
``shm/`` only through the engine client."""
from __future__ import annotations

import ast
import pathlib
import re

from server.config import OPTIONS, parser
from tests.support.docs import PAGES, README, all_blocks, anchor, headings

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("engine", "shm", "server", "bench", "tests", "proto") for p in (ROOT / d).rglob("*.py")]
MARKDOWN = [*PAGES, *sorted((ROOT / "bench").glob("*.md")), *sorted((ROOT / "k8s").glob("*.md"))]
CITING = [*MARKDOWN, ROOT / "proto" / "inference.proto", ROOT / "server" / "http" / "openapi.json",
          *sorted((ROOT / "k8s").rglob("*.yaml")), *sorted((ROOT / "docker").rglob("*file"))]


def test_configuration_table_matches_the_options():
    page = (ROOT / "docs/configuration.md").read_text()
    rows = {m.group(1): (m.group(2), m.group(3)) for m in
            re.finditer(r"^\| `(--[a-z-]+)` \| `([A-Z_]+)` \| ([^|]+?) \|", page, re.M)}
    assert set(rows) == {o.flag for o in OPTIONS}, set(rows) ^ {o.flag for o in OPTIONS}
    for o in OPTIONS:
        env, shown = rows[o.flag]
        assert env == o.env, o
        assert o.shown in shown, (o, shown)


def test_help_shows_every_default():
    text = parser().format_help()
    for o in OPTIONS:
        assert f"default {o.shown}" in " ".join(text.split()), o


def test_cited_documents_exist():
    """Every Markdown path that code or docs mention is in the repository."""
    for path in SOURCES + CITING:
        for ref in re.findall(r"[\w./-]+\.md\b", path.read_text()):
            assert (ROOT / ref).exists() or (path.parent / ref).exists(), f"{path}: {ref}"


def test_cited_sections_exist():
    """``docs/performance.md "Threads"``, ``README "Quick start"``: the page has that heading (or a
    paragraph that starts with it in bold)."""
    cite = re.compile(r'([\w./-]+\.md|\bREADME)`?,? \\?"([^"\\\n]+)\\?"')
    cited = 0
    for path in SOURCES + CITING:
        for ref, section in cite.findall(path.read_text()):
            target = README if ref == "README" else ROOT / ref if (ROOT / ref).exists() else path.parent / ref
            assert any(h.startswith(section) for h in headings(target)) or f"**{section}" in target.read_text(), \
                f"{path}: {ref} {section!r}"
            cited += 1
    assert cited >= 20


def test_markdown_links_resolve():
    """Every ``[text](path)`` and ``![alt](path)`` of the Markdown pages names a file that exists,
    and a ``#fragment`` a heading of that page."""
    for path in MARKDOWN:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.relative_to(ROOT)}: {target}"
            if fragment:
                assert fragment in [anchor(h) for h in headings(dest)], f"{path.relative_to(ROOT)}: {target}"


def test_every_shell_block_is_run_or_marked():
    """The rule at the top of docs/development.md: a ``sh`` block holds only curl commands (run by
    tests/spec/test_readme.py) or follows ``<!-- not run here: REASON -->``; every fence names its
    language, and shell is always ``sh``."""
    found = all_blocks()
    assert sum(b.lang == "sh" for b in found) >= 6
    for b in found:
        assert b.lang, f"{b}: a fence without a language"
        assert b.lang not in ("bash", "shell", "console", "zsh", "shell-session"), f"{b}: shell blocks are `sh`"
        if b.lang == "sh":
            assert b.runnable != b.marked, f"{b}: " + (
                "runnable, so must not be marked" if b.marked else "neither run by a test nor marked not run here")


def _imports(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports, at any depth of its code."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
    return names


def test_server_does_not_import_shm():
    for path in (ROOT / "server").rglob("*.py"):
        assert not any(n == "shm" or n.startswith("shm.") for n in _imports(path)), path


def test_server_packages_import_one_way():
    """docs/architecture.md "The packages of server/": the two front ends never import each
    other, and what they share imports neither."""
    front_ends = ("server.http", "server.grpc")
    for package in ("api", "generation", "text", "tools", "tenancy", "observability", "responses", "http", "grpc"):
        banned = [f for f in front_ends if f != f"server.{package}"]
        for path in (ROOT / "server" / package).rglob("*.py"):
            for name in _imports(path):
                assert not any(name == b or name.startswith(b + ".") for b in banned), f"{path}: {name}"
