"""Runs the choices of one HTTP request on the engine and yields text deltas.

Tokenization happened in the caller; here token ids go to the engine through
:mod:`engine.client` and come back as text through :class:`Detokenizer`.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator

from engine.client import (ClientDisconnected, DeadlineExceeded, EngineClient, EngineError,
                           EngineUnavailable, PromptTooLong, Saturated, Stream, Token)
from server.detokenizer import Detokenizer
from server.errors import APIError, bad_request
from server.params import GenerationRequest

ENGINE_TO_OPENAI = {"stop": "stop", "length": "length", "deadline": "deadline"}


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


def overload_error(e: Exception) -> APIError:
    """Saturated / EngineUnavailable -> 503 with Retry-After."""
    retry = getattr(e, "retry_after", 1)
    return APIError(503, str(e) or "engine unavailable", code="server_overloaded" if isinstance(e, Saturated)
                    else "engine_unavailable", headers={"Retry-After": str(retry)})


class Generation:
    """``n`` sequences for one prompt, submitted at construction.

    Args:
        prompt_ids: token ids. prompt_param: the request field they came from (for errors).
        watch_socket: the client connection; when it closes, every choice is cancelled.
    Raises:
        APIError: 400 when the prompt (plus ``max_tokens``) does not fit one sequence, naming
        both numbers; 503 when the engine is saturated or unavailable. Nothing stays submitted.
    """

    def __init__(self, engine: EngineClient, pieces: list[bytes], prompt_ids: list[int],
                 req: GenerationRequest, prompt_param: str, tenant: int = 0, watch_socket=None):
        if req.n > engine.capacity:
            raise bad_request(f"n={req.n} exceeds this server's capacity of {engine.capacity} "
                              "concurrent sequences", "n")
        try:
            max_new_tokens = engine.check_fits(len(prompt_ids), req.max_tokens)
        except PromptTooLong as e:
            param = req.max_tokens_param if e.max_new_tokens is not None else prompt_param
            raise bad_request(str(e), param, "context_length_exceeded") from None
        except ValueError as e:
            raise bad_request(str(e), prompt_param) from None
        self.req = req
        self.pieces = pieces
        self.prompt_tokens = len(prompt_ids)
        self.counts = [0] * req.n  # completion tokens per choice (each choice has its own thread)
        self.streams: list[Stream] = []
        params = req.sampling_params(max_new_tokens)
        try:
            for i in range(req.n):
                if params.seed is not None and i:  # one seed would make every choice the same
                    params = dataclasses.replace(params, seed=(params.seed + 1) % 2**32)
                self.streams.append(engine.submit(prompt_ids, params, priority=req.priority,
                                                  deadline_ms=req.deadline_ms, tenant=tenant,
                                                  watch_socket=watch_socket))
        except BaseException as e:
            self.close()  # nothing stays submitted
            if isinstance(e, (Saturated, EngineUnavailable)):
                raise overload_error(e) from None
            raise

    def deltas(self) -> Iterator[Delta]:
        """Deltas of every choice as they come; each choice ends with one finish_reason."""
        if len(self.streams) == 1:
            yield from self._choice(0)
            return
        merged: queue.Queue = queue.Queue()

        def pump(i):
            try:
                for d in self._choice(i):
                    merged.put(d)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                merged.put(e)
            merged.put(None)

        threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(len(self.streams))]
        for t in threads:
            t.start()
        running = len(threads)
        try:
            while running:
                item = merged.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            # Each pump closes its own stream; cancel what still runs (an error, or the client
            # left) and wait, so no pump reads a mailbox after it was given back.
            for stream in self.streams:
                stream.cancel()
            for t in threads:
                t.join()

    def _choice(self, index: int) -> Iterator[Delta]:
        stream = self.streams[index]
        detok = Detokenizer(self.pieces, self.req.stop)
        finish = None
        try:
            for token in stream:
                self.counts[index] += 1
                text = detok.push(token.id)
                if text or token.logprob is not None:
                    yield Delta(index, text, [token])
                if detok.stopped:
                    finish = "stop"
                    break
            else:
                finish = ENGINE_TO_OPENAI.get(stream.finish_reason, stream.finish_reason)
        except DeadlineExceeded:
            finish = "deadline"
        finally:
            stream.close()
        yield Delta(index, detok.flush(), [], finish)

    def collect(self) -> list[Choice]:
        """Run every choice to its end and close.

        Raises:
            ClientDisconnected: the client left (every choice was cancelled).
            APIError: 503 when the engine failed meanwhile.
        """
        choices = [Choice() for _ in self.streams]
        texts = [[] for _ in self.streams]
        try:
            for d in self.deltas():
                texts[d.index].append(d.text)
                choices[d.index].tokens.extend(d.tokens)
                choices[d.index].finish_reason = d.finish_reason or choices[d.index].finish_reason
        except ClientDisconnected:
            raise
        except EngineError as e:
            raise APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "1"}) from None
        finally:
            self.close()
        for choice, text in zip(choices, texts):
            choice.text = "".join(text)
        return choices

    def close(self) -> None:
        """Cancel and release every choice still running (idempotent)."""
        for s in self.streams:
            s.close()

    def usage(self) -> dict:
        completion = sum(self.counts)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}
