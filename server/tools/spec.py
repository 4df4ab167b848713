"""What a request asks of tool calling, protocol-neutral (OpenAI API reference, Chat
Completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``). Built by
``server/api/tools.py`` from a body; read by the prompt (``server/tools/formats.py``), the
output parser and the grammar."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tool:
    """One function the model may call.

    Attributes:
        name: ``[a-zA-Z0-9_-]{1,64}`` (OpenAI's rule). description: may be "".
        parameters: its arguments' JSON Schema (an object schema; ``{"type": "object",
            "properties": {}}`` when the request gave none, as OpenAI's default).
        strict: the request's ``strict`` (arguments are always constrained to ``parameters``
            here when a call is constrained; ``strict`` changes nothing else).
        path: where the function's fields are in the request, as the client sent them
            (``tools[0].function``; the Responses API's ``tools[0]``), for the refusals that
            name one of them (``{path}.parameters``). Not part of the tool's identity.
    """

    name: str
    description: str
    parameters: dict
    strict: bool = False
    path: str = field(default="", compare=False)

    def openai(self) -> dict:
        """The tool as OpenAI's request shape, which chat templates take as ``tools``."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


#: tool_choice modes: no call, the model decides, at least one call, the one named function.
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and what it lets the model do with them.

    Attributes:
        tools: the functions, names unique, in request order.
        choice: :data:`NONE`, :data:`AUTO`, :data:`REQUIRED` or :data:`NAMED`.
        name: the function :data:`NAMED` forces (None otherwise).
        parallel: more than one call in one answer may be made (``parallel_tool_calls``; never
            under :data:`NAMED`, which makes one call).
    """

    tools: tuple[Tool, ...]
    choice: str = AUTO
    name: str | None = None
    parallel: bool = True

    @property
    def calls_only(self) -> bool:
        """The answer can only be calls (``required`` or a named function): its grammar admits
        nothing else, and no text of it is content (the one place this rule is written)."""
        return self.choice in (REQUIRED, NAMED)

    def parameters_param(self, i: int) -> str:
        """The client's field of the ``i``-th tool's ``parameters``."""
        return f"{self.tools[i].path or f'tools[{i}].function'}.parameters"

    def callable(self) -> tuple[Tool, ...]:
        """The functions the answer may call: all of them, or only the named one."""
        if self.choice == NONE:
            return ()
        return tuple(t for t in self.tools if self.choice != NAMED or t.name == self.name)
