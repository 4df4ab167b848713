"""llguidance's parser limits, the same in the front end's check of a grammar
(``server.structured.check``) and in the engine's compile of it (``engine.llama.grammar``).

A module of their own, which imports llguidance only: the front end's grammar checkers are child
processes that import the check and this, and llama.cpp's bindings and numpy (what
``engine.llama.grammar`` needs) made each of them 40 MB of resident memory instead of 18.
"""
from __future__ import annotations

import llguidance

#: ``initial_lexer_fuel`` bounds the lexer's construction (about 50k units a millisecond, so at
#: most about 20 ms), ``max_grammar_size`` the grammar's symbols, ``step_lexer_fuel`` and
#: ``step_max_items`` one mask (about 14k and 20k units a millisecond: at most about 7 ms).
LIMITS = dict(initial_lexer_fuel=1_000_000, max_grammar_size=200_000, step_lexer_fuel=100_000,
              step_max_items=50_000, verbose_errors=False)


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)
