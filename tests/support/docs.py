"""The README and the pages of ``docs/`` as tests read them: their fenced blocks, which shell
blocks tests run, their headings and links. The rule for shell blocks is at the top of
docs/development.md."""
from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE_URL = "http://127.0.0.1:8080"
NOT_RUN = re.compile(r"^\s*<!-- not run here: \S.*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marked: bool  # preceded by <!-- not run here: REASON -->

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"

    def commands(self) -> list[str]:
        """The block's commands: continuation lines joined, and the lines of a single-quoted
        string that spans several (a JSON body written out) kept in one command, as the shell
        reads them; blank lines and comments dropped."""
        commands, pending = [], ""
        for line in self.code.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            if pending.count("'") % 2 == 0:
                commands.append(pending.strip())
                pending = ""
        assert not pending, f"{self}: a quote left open"
        return [c for c in commands if c and not c.startswith("#")]

    @property
    def runnable(self) -> bool:
        """A ``sh`` block that tests/spec/test_readme.py runs: only curl commands."""
        return self.lang == "sh" and bool(self.commands()) and all(c.startswith("curl ") for c in self.commands())


def blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced block of a Markdown file (indented ones inside list items included)."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.group(1), m.group(2), m.group(3).strip()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{ticks}`*\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        assert i < len(lines), f"{path}:{start + 1}: unclosed fence"
        marked = start > 0 and bool(NOT_RUN.match(lines[start - 1]))
        found.append(Block(path, start + 1, lang, "\n".join(body) + "\n", marked))
        i += 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def curl_commands() -> list[str]:
    """Each curl command of the README's and docs/'s runnable shell blocks."""
    return [c for b in all_blocks() if b.runnable and not b.marked for c in b.commands()]


def headings(path: pathlib.Path) -> list[str]:
    """The headings' text, backticks removed."""
    return [m.group(1).replace("`", "").strip() for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
