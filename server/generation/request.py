"""What a generation is asked and what it answers, protocol-neutral: :class:`GenerationRequest`
(the parsed request), :class:`Delta` and :class:`Choice` (its output) and :class:`Usage` (its
token counts). Every front end builds the first and reads the others."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Priority, SamplingParams
from engine.stream import Token
from server.structured.constraint import OutputConstraint
from server.tools.parser import ToolCallDelta
from server.tools.spec import ToolRequest


@dataclass(frozen=True)
class GenerationRequest:
    """What one request asks of the engine, before its prompt is tokenized; a value, built once
    by a front end's parser and read by everything after it.

    Attributes:
        sampling: the engine's settings (``max_new_tokens`` None = up to the sequence limit).
        max_tokens: as asked; 0 generates nothing (each choice ends at once with ``length``).
        max_tokens_param: the request field ``max_new_tokens`` came from (named in errors).
        stop: stop strings (text, applied here). n: choices, each its own sequence.
        stream, include_usage, obfuscate: the response's shape (read by the protocol, not here;
            ``obfuscate``: ``stream_options.include_obfuscation``, padded chunks).
        priority, deadline_ms: admission class and deadline (None = none).
        constraint: the structured output the answer must follow (None: none), carrying the
            field it came from; the generator writes its grammar (``sampling.grammar`` is None
            as parsed).
        tools: the request's tools and tool choice (None: no tools; chat only).
        echo: each choice starts with its prompt (legacy completions); with logprobs, the
            prompt is scored too (the engine's scoring kind), its entries first.
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    obfuscate: bool = False
    priority: Priority = Priority.NORMAL
    deadline_ms: float | None = None
    constraint: OutputConstraint | None = None
    tools: ToolRequest | None = None
    echo: bool = False

    @property
    def scores(self) -> bool:
        """The prompt's log-probabilities are asked for (``echo`` with ``logprobs``)."""
        return self.echo and self.sampling.logprobs is not None


@dataclass
class ToolCall:
    """One finished tool call: ``id``, the function's ``name``, its ``arguments`` (JSON text)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """OpenAI's ``message.tool_calls[]`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """A piece of one choice: ``text`` (may be ''; content, with any tool-call text taken out),
    the tokens' logprob entries, the pieces of tool calls, and the ``finish_reason`` on the
    choice's last delta (None before). ``echo``: this is the choice's echoed prompt (its first
    delta, legacy completions), whose text writes control tokens as their text."""

    index: int
    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    echo: bool = False


@dataclass
class Choice:
    """One finished choice: its content text, its tokens (for logprobs; the first
    ``prompt_entries`` of them its echoed prompt's), its tool calls, its finish reason
    (``tool_calls`` when calls end it)."""

    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_entries: int = 0


@dataclass(frozen=True)
class Usage:
    """A generation's token counts: ``prompt_tokens`` (each prompt once), ``completion_tokens``
    (every choice's), and ``cached_tokens``, the prompt tokens the prefix cache gave every choice
    of their prompt. A request that submitted nothing has all three at 0."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def openai(self) -> dict:
        """OpenAI's ``usage`` object (CompletionUsage), ``prompt_tokens_details`` included."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class EmbeddingRequest:
    """What ``POST /v1/embeddings`` (and gRPC ``Embed``) asks (parsed by ``server/api/embeddings.py``).

    Attributes:
        inputs: each input, its text or its token ids, in the request's order.
        encoding_format: ``float`` (JSON numbers) or ``base64`` (little-endian float32 bytes).
        dimensions: the vector length asked (None: the model's).
        truncate: keep each input's last this many tokens (None: refuse a long input; -1: as
            many as fit).
        priority: the scheduling class (this server's extension, as on the generation routes).
    """

    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate: int | None = None
    priority: Priority = Priority.NORMAL
