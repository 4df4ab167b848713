"""One choice's output as its tokens arrive (:class:`ChoiceState`), in one order:

    echo (legacy completions) -> detokenizer -> tool-call parser -> stop strings -> finish reason

Stop strings apply to the text the client sees, after the tool parser took the calls out: never
to a call's envelope or its arguments (a stop matched there would cut the arguments while the
answer still said ``tool_calls``).
"""
from __future__ import annotations

import time
from typing import Callable, Protocol

from engine.stream import Token
from server.generation.request import Delta, ToolCallDelta
from server.text.detokenizer import Detokenizer, StopStrings


class ToolParser(Protocol):
    """What a choice needs of a tool-call parser (``server.tools.parser.ToolCallParser``)."""

    done: bool
    n_calls: int

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]: ...


class ChoiceState:
    """Choice ``index``'s text, calls, counts and timing, fed its tokens by the output loop.

    Args:
        index: the choice's number (OpenAI's: choice ``j`` of prompt ``p`` is ``p * n + j``).
        pieces: ``token id -> bytes`` the text is read with (``Tokenizer.pieces``).
        stops: stop strings; the visible text ends before the first one completed.
        parser: reads the text for tool calls (None: no tools); once it is ``done`` (its most
            calls made) the choice ends.
        echo: the prompt's text the choice starts with (None: no echo).
        prompt_entries: the echoed prompt's logprob entries (``Stream.prompt_logprobs``), read
            when the echo goes out, with the first tokens (once the prompt is scored).

    Attributes:
        completion_tokens: tokens read (those after a stop string ended the choice are not).
        finish_reason: None until the last delta (``stop``, ``length``, ``tool_calls``, ...).
        tool_calls: calls the choice made, counted at its end.
        first_token_at: ``time.monotonic()`` when its first token arrived (None: none did).
        token_gaps: seconds between consecutive tokens; tokens that arrive together (the
            reader fell behind) share the gap since the previous arrival.
    """

    def __init__(self, index: int, pieces: list[bytes], stops: list[str], parser: ToolParser | None = None,
                 echo: str | None = None, prompt_entries: Callable[[], list[Token]] = list):
        self.index, self.parser, self.echo = index, parser, echo
        self.detokenizer = Detokenizer(pieces)
        self.stops = StopStrings(stops)
        self._prompt_entries = prompt_entries
        self._echo_due = echo is not None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.tool_calls = 0
        self.first_token_at: float | None = None
        self.token_gaps: list[float] = []
        self._last_token_at: float | None = None

    @property
    def ended(self) -> bool:
        """Its last delta was made: later tokens (a cancelled sequence's last ones) are ignored."""
        return self.finish_reason is not None

    def push(self, tokens: list[Token]) -> list[Delta]:
        """Read the choice's next tokens. Returns its deltas: the echo first (on the first
        push), one per token that shows text, a call piece or a logprob entry, and the last
        delta (``finish_reason`` ``stop``, or ``tool_calls`` when calls were made) if a stop
        string or the tool parser ended the choice within them; then the caller cancels the
        sequence. Nothing once :attr:`ended`."""
        if self.ended:
            return []
        deltas = [self._echo()] if self._echo_due else []
        self._arrived(len(tokens))
        for token in tokens:
            self.completion_tokens += 1
            text, calls = self.detokenizer.push(token.id), []
            if self.parser is not None:
                text, calls = self.parser.feed(text)
            text = self.stops.push(text)
            if text or calls or token.logprob is not None:
                deltas.append(Delta(self.index, text, [token], tool_calls=calls))
            if self.stops.stopped or (self.parser is not None and self.parser.done):
                deltas.append(self._last("", "stop"))
                break
        return deltas

    def finish(self, reason: str) -> Delta:
        """The last delta once the sequence finished with ``reason`` (``Stream.finish_reason``;
        ``length`` for a choice that generated nothing): the rest of the text, read for calls
        to its end, stop strings applied (``stop`` if one completed), and ``tool_calls`` as the
        reason when calls were made and it stopped (OpenAI's). A choice that never pushed
        starts it with its echo's text."""
        echo = self.echo if self._echo_due else ""
        self._echo_due = False
        last = self._last(self.detokenizer.flush(), reason)
        last.text = echo + last.text
        return last

    def _echo(self) -> Delta:
        self._echo_due = False
        return Delta(self.index, self.echo, self._prompt_entries(), echo=True)

    def _last(self, text: str, reason: str) -> Delta:
        calls = []
        if self.parser is not None:
            text, calls = self.parser.feed(text, final=True)
        text = self.stops.push(text) + self.stops.flush()
        if self.stops.stopped:
            reason = "stop"
        if self.parser is not None:
            self.tool_calls = self.parser.n_calls
            if self.tool_calls and reason == "stop":
                reason = "tool_calls"
        self.finish_reason = reason
        return Delta(self.index, text, [], reason, calls)

    def _arrived(self, n_tokens: int) -> None:
        if not n_tokens:
            return
        now = time.monotonic()
        last, self._last_token_at = self._last_token_at, now
        if last is None:
            self.first_token_at = now
            n_tokens -= 1
            last = now
        self.token_gaps.extend([(now - last) / max(1, n_tokens)] * n_tokens)
