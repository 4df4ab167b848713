"""A grammar checker's child process (``python -m server.structured.check_child``): answer each
line of stdin, a question of :class:`server.structured.check.GrammarChecker`'s protocol, with one
line, until stdin closes (the parent exited or gave up on it). A fresh interpreter, not a fork of
a threaded worker."""
from __future__ import annotations

import json
import sys

from server.structured.check import check, check_schemas


def main() -> None:
    for line in sys.stdin:
        question = json.loads(line)
        answer = check(*question[1:]) if question[0] == "grammar" else check_schemas(question[1])
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
