"""The front-end-neutral request path, shared by every front end (HTTP now, gRPC next):

    render/tokenize -> submit n sequences -> follow their tokens -> detokenize with stop
    strings -> usage and timings

No HTTP type appears here: errors are those of :mod:`engine.errors`, mapped by each protocol
in one place of its own (``server/errors.py`` for HTTP).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

from engine.client import EngineClient
from engine.errors import InvalidRequest, PromptTooLong
from engine.request import Priority, SamplingParams
from engine.stream import Stream, Timings, Token, follow
from server.chat_template import ChatTemplate
from server.detokenizer import Detokenizer
from server.tokenizer import Tokenizer


@dataclass
class GenerationRequest:
    """What one request asks of the engine, before its prompt is tokenized.

    Attributes:
        sampling: the engine's settings (``max_new_tokens`` None = up to the sequence limit).
        max_tokens_param: the request field ``max_new_tokens`` came from (named in errors).
        stop: stop strings (text, applied here). n: choices, each its own sequence.
        stream, include_usage: the response's shape (read by the protocol, not here).
        priority, deadline_ms: admission class and deadline (None = none).
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_param: str = "max_tokens"
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    priority: Priority = Priority.NORMAL
    deadline_ms: float | None = None


@dataclass
class Delta:
    """A piece of one choice: ``text`` (may be ''), the tokens' logprob entries, and the
    ``finish_reason`` on the choice's last delta (None before)."""

    index: int
    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Choice:
    """One finished choice: its whole text, its tokens (for logprobs), its finish reason."""

    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    """``n`` sequences for one prompt, submitted at construction, read by one output loop.

    Args:
        prompt_ids: token ids. prompt_param: the request field they came from (named in errors).
        watch_socket: the client connection; when it closes, every choice is cancelled.
    Raises:
        InvalidRequest: ``n`` beyond capacity; PromptTooLong (naming the prompt's or the
        max-tokens field) when it does not fit one sequence.
        Saturated, EngineUnavailable: no room or no engine. Nothing stays submitted.
    """

    def __init__(self, engine: EngineClient, pieces: list[bytes], prompt_ids: list[int],
                 req: GenerationRequest, prompt_param: str, tenant: int = 0, weight: float = 1.0,
                 watch_socket=None):
        if req.n > engine.capacity:
            raise InvalidRequest(f"n={req.n} exceeds this server's capacity of {engine.capacity} "
                                 "concurrent sequences", "n")
        self.req, self.pieces, self.watch_socket = req, pieces, watch_socket
        self.prompt_tokens = len(prompt_ids)
        self.counts = [0] * req.n  # completion tokens per choice
        self.streams: list[Stream] = []
        params = req.sampling
        try:
            for i in range(req.n):
                if params.seed is not None and i:  # one seed would make every choice the same
                    params = dataclasses.replace(params, seed=(params.seed + 1) % 2**32)
                self.streams.append(engine.submit(prompt_ids, params, priority=req.priority,
                                                  deadline_ms=req.deadline_ms, tenant=tenant,
                                                  weight=weight, watch_socket=watch_socket))
        except PromptTooLong as e:
            e.param = req.max_tokens_param if e.max_new_tokens is not None else prompt_param
            self.close()
            raise
        except InvalidRequest as e:
            if e.param == "prompt":
                e.param = prompt_param
            self.close()
            raise
        except BaseException:
            self.close()  # nothing stays submitted
            raise

    def deltas(self) -> Iterator[Delta]:
        """Deltas of every choice as they come; each choice ends with one ``finish_reason``.

        Raises:
            ClientDisconnected: the client left (every choice was cancelled).
            EngineUnavailable: the engine failed meanwhile.
        """
        detoks = [Detokenizer(self.pieces, self.req.stop) for _ in self.streams]
        ended = [False] * len(self.streams)
        try:
            for k, tokens in follow(self.streams, self.watch_socket):
                if ended[k]:
                    continue  # a stop string ended it; its cancellation is being followed
                for token in tokens:
                    self.counts[k] += 1
                    text = detoks[k].push(token.id)
                    if text or token.logprob is not None:
                        yield Delta(k, text, [token])
                    if detoks[k].stopped:
                        self.streams[k].cancel()
                        ended[k] = True
                        yield Delta(k, "", [], "stop")
                        break
                else:
                    if self.streams[k].finished:
                        ended[k] = True
                        yield Delta(k, detoks[k].flush(), [], self.streams[k].finish_reason)
        finally:
            self.close()

    def collect(self) -> list[Choice]:
        """Run every choice to its end and close. Raises as :meth:`deltas`."""
        choices = [Choice() for _ in self.streams]
        texts = [[] for _ in self.streams]
        for d in self.deltas():
            texts[d.index].append(d.text)
            choices[d.index].tokens.extend(d.tokens)
            choices[d.index].finish_reason = d.finish_reason or choices[d.index].finish_reason
        for choice, text in zip(choices, texts):
            choice.text = "".join(text)
        return choices

    def close(self) -> None:
        """Cancel every unfinished choice, then wait for each and release it (idempotent)."""
        for s in self.streams:
            if not s.finished:
                s.cancel()
        for s in self.streams:
            s.close()

    def usage(self) -> dict:
        completion = sum(self.counts)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def timings(self, choice: int = 0) -> Timings:
        return self.streams[choice].timings()


class Generator:
    """Starts generations from text: what every front end needs (engine client, tokenizer,
    chat template), built once per process.

    Args:
        engine: the engine client. tokenizer: the served model's. template: its chat template.
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, template: ChatTemplate):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template

    def chat(self, messages: list[dict], req: GenerationRequest, prompt_param: str = "messages",
             **submit) -> Generation:
        """``messages`` (``[{"role", "content": str}]``) rendered with the chat template.
        ``submit``: ``tenant``, ``weight``, ``watch_socket``. Raises as :class:`Generation`."""
        return Generation(self.engine, self.tokenizer.pieces, self.template.encode(messages), req,
                          prompt_param, **submit)

    def complete(self, text: str, req: GenerationRequest, prompt_param: str = "prompt", **submit) -> Generation:
        """A plain-text prompt (BOS added if the model wants it). Raises as :class:`Generation`."""
        return Generation(self.engine, self.tokenizer.pieces,
                          self.tokenizer.encode(text, special=False, add_bos=True), req, prompt_param, **submit)
