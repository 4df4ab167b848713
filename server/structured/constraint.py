"""What a request's answer must be, as parsed from its fields: :class:`OutputConstraint`
(OpenAI's ``response_format``, the Responses API's ``text.format``, vLLM's
``structured_outputs``; made by ``server/api/structured.py``). It carries the client's value
itself (a schema, a regex, choices, a grammar's text) and the field it came from; the llguidance
grammar is written from it once, by the generator (:meth:`OutputConstraint.grammar` alone, or
with tools by ``server/tools/grammar.py``, which inlines :attr:`OutputConstraint.schema`)."""
from __future__ import annotations

from dataclasses import dataclass

import llguidance

from engine.errors import InvalidRequest
from server.structured.schema import SEPARATORS, guided

#: The kinds of constraint: a JSON schema (``value``: the schema, its objects closed by
#: :func:`server.structured.schema.closed_objects`; its layout is resolved by :attr:`schema`),
#: any JSON object (the same, of ``{"type": "object"}``), a regular expression (its text), one
#: of a list of strings (a tuple), a grammar (llguidance's Lark or llama.cpp's GBNF text).
JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR = "json_schema", "json_object", "regex", "choice", "grammar"


@dataclass(frozen=True)
class OutputConstraint:
    """One request's structured output.

    Attributes:
        kind: :data:`JSON_SCHEMA`, :data:`JSON_OBJECT`, :data:`REGEX`, :data:`CHOICE` or
            :data:`GRAMMAR`.
        value: as the kinds above say (a JSON kind's schema is shared: never changed).
        param: the client's field it came from (``response_format.json_schema.schema``,
            ``structured_outputs.regex``, ``text.format.schema``...), named by its refusals.
        separators: a JSON kind's separators where its schema names no layout of its own (the
            served model's, ``Generator.laid_out``).
    """

    kind: str
    value: object
    param: str
    separators: tuple[str, str] = SEPARATORS

    @property
    def schema(self) -> dict | None:
        """The JSON schema an answer must follow (a JSON kind), its ``x-guidance`` options
        resolved with :attr:`separators` (:func:`server.structured.schema.guided`), else None: a
        regex, a choice or a grammar leaves no place for a tool call beside it."""
        return guided(self.value, self.separators) if self.kind in (JSON_SCHEMA, JSON_OBJECT) else None

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form, or Lark) of this constraint alone.

        Raises:
            InvalidRequest: naming :attr:`param`, for what llguidance cannot even write down (a
                schema holding an integer beyond 64 bits, which JSON allows).
        """
        try:
            if self.kind in (JSON_SCHEMA, JSON_OBJECT):
                return llguidance.LLMatcher.grammar_from_json_schema(self.schema)  # options resolved
            if self.kind == REGEX:
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            if self.kind == CHOICE:
                return llguidance.grammar_from("choice", list(self.value))
            return llguidance.grammar_from("grammar", self.value)  # Lark as it is, GBNF converted
        except ValueError as e:
            raise InvalidRequest(f"{self.param} cannot be enforced: {e}", self.param) from None
