"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI API reference), with SSE
streaming as OpenAI sends it: ``data: <chunk>`` events, ``data: [DONE]`` last."""
from __future__ import annotations

import codecs
import secrets
import time
from typing import Iterator

import falcon

from engine.errors import ClientDisconnected
from engine.llama.tokenizer import Tokenizer
from server.api.requests import parse_generation, parse_messages, parse_prompt, render_options
from server.config import ServerConfig
from server.errors import http_error
from server.generation.generation import Generation
from server.generation.pipeline import Generator
from server.model_router import CHAT, GENERATION, ModelRouter
from server.generation.request import Choice, Delta, GenerationRequest, ToolCallDelta
from server.http.body import read_json
from server.http.json import dumps, sse, sse_headers


class _Completions:
    """Shared flow: pick the model -> parse -> tokenize -> check length -> submit -> respond
    (JSON or SSE). The shapes take the model's tokenizer (``tok``): logprobs name its tokens."""

    chat = False
    object_name = ""
    id_prefix = ""
    observed = True  # telemetry (server/http/middleware.py, Observe)

    def __init__(self, config: ServerConfig, models: ModelRouter):
        self.config, self.models = config, models

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        model, served, tenant = self.models.pick(body, req.context.tenant, CHAT if self.chat else GENERATION)
        generator, tok = served.generator, served.tokenizer
        if self.chat:
            generator.chat_template("messages")  # a model without one: that, before any field
        greq = parse_generation(body, chat=self.chat)
        gen = self.start(generator, body, greq, tenant=tenant,
                         watch_socket=req.env.get("gunicorn.socket"))
        req.context.record.attach(gen, body.get("messages" if self.chat else "prompt"))
        meta = {"id": f"{self.id_prefix}-{secrets.token_hex(12)}", "created": int(time.time()), "model": model}
        if greq.stream:
            sse_headers(resp)
            resp.stream = self.sse_events(tok, gen, greq, meta)
            return
        choices = gen.collect()
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps({**meta, "object": self.object_name, "usage": gen.usage().openai(),
                           "choices": [self.choice(tok, i, c, greq) for i, c in enumerate(choices)]})

    def start(self, generator: Generator, body: dict, greq: GenerationRequest, **submit) -> Generation:
        raise NotImplementedError

    # -- streaming ------------------------------------------------------------------------------
    def sse_events(self, tok: Tokenizer, gen: Generation, greq: GenerationRequest, meta: dict) -> Iterator[bytes]:
        """The SSE body. The status line and headers go out at once (an empty first chunk makes
        gunicorn send them), and an SSE comment every ``--sse-keepalive-s`` while nothing is due
        (queued, or a long prefill), so proxies do not cut a silent stream. With
        ``stream_options.include_obfuscation``, every chunk is padded (``server.http.json.obfuscated``)."""
        chunk = {**meta, "object": self.object_name + ".chunk" if self.chat else self.object_name}
        if greq.include_usage and self.chat:
            chunk["usage"] = None  # chat chunks carry a null usage; the legacy schema has no null
        yield b""
        try:
            state: dict = {}  # per-choice state a route keeps across chunks (text offsets)
            pad = greq.obfuscate
            if self.chat:
                for i in range(gen.n_choices):
                    yield sse({**chunk, "choices": [self.chunk_choice(tok, Delta(i), greq, state, first=True)]}, pad)
            for d in gen.deltas(keepalive_s=self.config.sse_keepalive_s or None):
                if d is None:
                    yield b": keep-alive\n\n"
                    continue
                yield sse({**chunk, "choices": [self.chunk_choice(tok, d, greq, state)]}, pad)
            if greq.include_usage:
                yield sse({**chunk, "choices": [], "usage": gen.usage().openai()}, pad)
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - headers are sent: the error becomes an event
            yield sse(http_error(e)[1])
        finally:
            gen.close()
        yield b"data: [DONE]\n\n"

    # -- shapes ---------------------------------------------------------------------------------
    @staticmethod
    def token_entry(tok: Tokenizer, token_id: int, logprob: float) -> dict:
        """Chat's logprob entry; a control token as its text (it was "", so two in one top list
        were one key apart from nothing)."""
        piece = tok.piece(token_id, special=True)
        return {"token": token_text(piece), "logprob": logprob, "bytes": list(piece)}


class ChatCompletions(_Completions):
    chat = True
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    def start(self, generator: Generator, body: dict, greq: GenerationRequest, **submit) -> Generation:
        messages = parse_messages(body, self.config.max_messages)
        return generator.chat(messages, greq, render=render_options(body, messages), **submit)

    def logprobs(self, tok: Tokenizer, tokens, greq) -> dict | None:
        if greq.sampling.logprobs is None:
            return None
        return {"content": [{**self.token_entry(tok, t.id, t.logprob),
                             "top_logprobs": [self.token_entry(tok, i, lp) for i, lp in t.top]} for t in tokens],
                "refusal": None}

    def choice(self, tok: Tokenizer, i: int, c: Choice, greq) -> dict:
        message = {"role": "assistant", "content": c.text, "refusal": None}
        if c.tool_calls:  # OpenAI: content is null when the answer is only calls
            message.update(content=c.text or None, tool_calls=[t.openai() for t in c.tool_calls])
        return {"index": i, "message": message, "logprobs": self.logprobs(tok, c.tokens, greq),
                "finish_reason": c.finish_reason}

    def chunk_choice(self, tok: Tokenizer, d: Delta, greq, state: dict, first: bool = False) -> dict:
        if first:  # an answer that can only be calls has null content, as its non-streamed message
            delta = {"role": "assistant", "content": None if calls_only(greq) else ""}
        else:
            delta = {"content": d.text} if d.text else {}
        if d.tool_calls:
            delta["tool_calls"] = [tool_call_delta(c) for c in d.tool_calls]
        return {"index": d.index, "delta": delta,
                "logprobs": None if first else self.logprobs(tok, d.tokens, greq), "finish_reason": d.finish_reason}


def calls_only(greq: GenerationRequest) -> bool:
    """Whether the answer can only be tool calls (``tool_choice`` required or a named function)."""
    return greq.tools is not None and greq.tools.calls_only


def tool_call_delta(c: ToolCallDelta) -> dict:
    """OpenAI's ``delta.tool_calls[]`` entry: ``index`` always; ``id``, ``type`` and the name
    on a call's first piece; ``arguments`` text on every piece."""
    if c.id is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class Completions(_Completions):
    object_name = "text_completion"
    id_prefix = "cmpl"

    def start(self, generator: Generator, body: dict, greq: GenerationRequest, **submit) -> Generation:
        return generator.complete(parse_prompt(body, generator.engine.capacity // greq.n), greq, **submit)

    def logprobs(self, tok: Tokenizer, tokens, greq, offsets: "TextOffsets", prompt_entries: int = 0) -> dict | None:
        """Legacy shape: tokens, token_logprobs, top_logprobs (token -> logprob: the ``logprobs``
        most likely and the chosen token, so up to ``logprobs + 1`` entries, as OpenAI's legacy
        API and vLLM give them) and text_offset (characters into the completion's text where
        each token starts). With ``echo``, the prompt's tokens come first (``prompt_entries`` of
        them), the first with a null logprob and top_logprobs. A control token is written as its
        text (``<|im_end|>``) in tokens and keys; the offsets count it where the text holds it
        (an echoed prompt, but a leading BOS the model's tokenizer adds), not where it does not
        (generated text leaves control tokens out)."""
        if greq.sampling.logprobs is None:
            return None
        piece = tok.piece
        texts = [token_text(piece(t.id, special=True)) for t in tokens]
        return {"tokens": texts,
                "token_logprobs": [t.logprob for t in tokens],
                # null where a token has no log-probability: an echoed prompt's first token
                "top_logprobs": [None if t.logprob is None else
                                 {**{token_text(piece(i, special=True)): lp for i, lp in t.top}, text: t.logprob}
                                 for t, text in zip(tokens, texts)],
                "text_offset": [offsets.advance(piece(t.id, special=k < prompt_entries and not (
                    k == 0 and tok.add_bos and t.id == tok.bos))) for k, t in enumerate(tokens)]}

    def choice(self, tok: Tokenizer, i: int, c: Choice, greq) -> dict:
        return {"index": i, "text": c.text,
                "logprobs": self.logprobs(tok, c.tokens, greq, TextOffsets(), c.prompt_entries),
                "finish_reason": c.finish_reason}

    def chunk_choice(self, tok: Tokenizer, d: Delta, greq, state: dict, first: bool = False) -> dict:
        offsets = state.get(d.index)
        if offsets is None:  # not setdefault: that built one (and its UTF-8 decoder) every chunk
            offsets = state[d.index] = TextOffsets()
        return {"index": d.index, "text": d.text,
                "logprobs": self.logprobs(tok, d.tokens, greq, offsets, len(d.tokens) if d.echo else 0),
                "finish_reason": d.finish_reason}


class TextOffsets:
    """Character offset of each token in a choice's text; a character split over tokens
    belongs to the token that completes it."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def advance(self, piece: bytes) -> int:
        """Offset where the token with these bytes starts; moves past it."""
        start = self.chars
        self.chars += len(self._utf8.decode(piece))
        return start


def token_text(piece: bytes) -> str:
    """A token as text for logprobs; a piece that is not whole UTF-8 (part of a character) is
    written ``bytes:\\xe4\\xbd``, as OpenAI's API does, so distinct tokens stay distinct."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
