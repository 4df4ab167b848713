"""The repository explains itself: the README's configuration table is the configuration, the
documents that code cites exist, and ``server/`` reaches ``shm/`` only through the engine client."""
from __future__ import annotations

import ast
import pathlib
import re

from server.config import OPTIONS, parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("engine", "shm", "server", "bench", "tests", "proto") for p in (ROOT / d).rglob("*.py")]


def test_readme_configuration_table_matches_the_options():
    readme = (ROOT / "README.md").read_text()
    rows = {m.group(1): (m.group(2), m.group(3)) for m in
            re.finditer(r"^\| `(--[a-z-]+)` \| `([A-Z_]+)` \| ([^|]+?) \|", readme, re.M)}
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
    texts = SOURCES + [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for path in texts:
        for ref in re.findall(r"[\w./-]+\.md\b", path.read_text()):
            assert (ROOT / ref).exists() or (path.parent / ref).exists(), f"{path}: {ref}"


def test_server_does_not_import_shm():
    for path in (ROOT / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "shm" or n.startswith("shm.") for n in names), path
