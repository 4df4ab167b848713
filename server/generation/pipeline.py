"""The front-end-neutral request path, shared by the HTTP and the gRPC front end:

    render/tokenize (:class:`Generator`) -> prepare (:class:`Generation`) -> admit and submit
    n sequences (:meth:`Generation.submit`) -> follow their tokens -> detokenize with stop
    strings -> usage and timings

No HTTP or gRPC type appears here: errors are those of :mod:`engine.errors`, mapped to both
protocols in one place (``server/errors.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Callable, Iterator

from engine.client import EngineClient
from engine.errors import ConstraintFailed, InvalidRequest, PromptTooLong
from engine.request import RequestKind, SamplingParams, check_prompt_fits, reduce_seed
from engine.stream import Stream, Timings, follow
from engine.llama.tokenizer import Tokenizer
from server.generation.request import Choice, Delta, GenerationRequest, ToolCall, Usage
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import DEFAULT_TENANT, Tenant
from server.text.chat_template import ChatTemplate
from server.text.detokenizer import Detokenizer, StopStrings
from server.structured.check import CheckedGrammars
from server.tools.formats import detect
from server.tools.grammar import checked_arguments, tool_grammar
from server.tools.parser import ToolCallParser
from server.tools.spec import NONE, Tool, ToolRequest

#: The text of OpenAI's default prompt: the document separator, a new document's start.
DOCUMENT_START = "<|endoftext|>"
#: Generated tokens are charged to the tenant's token bucket every this many tokens or seconds,
#: whichever comes first, so a long answer keeps its tenant's bucket current with few calls.
CHARGE_EVERY_TOKENS, CHARGE_EVERY_S = 16, 0.1


def check_choices(engine: EngineClient, n_prompts: int, n: int, tenant: Tenant) -> int:
    """The number of choices (sequences) a request asks for, if the server and the tenant can
    hold them all at once.

    Raises:
        InvalidRequest: more than the capacity or the tenant's ``max_concurrent`` (param ``n``).
    """
    choices = n_prompts * n
    for limit, whose in ((engine.capacity, "this server's capacity"), (tenant.max_concurrent, "this tenant's limit")):
        if limit is not None and choices > limit:
            raise InvalidRequest(f"{choices} choices (n={n} for {n_prompts} prompts) exceed {whose} of {limit} "
                                 "concurrent sequences", "n" if n > 1 or n_prompts == 1 else "prompt")
    return choices


class Generation:
    """``n`` sequences for each prompt, read by one output loop. Choice ``p * n + j`` is choice
    ``j`` of prompt ``p`` (OpenAI's numbering).

    Building one only prepares it (checks the number of choices, talks to nothing);
    :meth:`submit` admits and submits it. The tenant's rate limits are taken there (one
    request, the prompt tokens of every choice) and its generated tokens charged while they are
    produced. Its priority caps the request's; its index and weight travel to the engine's fair
    share (:meth:`Tenant.share`).

    Args:
        prompts: token ids of each prompt. prompt_param: the request field they came from.
        tenant: who asks. limiter: its rate limits (None: none).
        watch_socket: the client connection; when it closes, every choice is cancelled.
        sampling: the engine's settings, the final grammar included (None: ``req.sampling``).
        grammar_param: the field a grammar failure names (``tools`` when it holds tools).
        new_tool_parser: a fresh :class:`server.tools.parser.ToolCallParser` for one choice's
            text (None: no tools, or ``tool_choice: "none"``); one that reads one call at most
            ends the choice (``tool_calls``) once it is complete.
        echo_texts: with ``req.echo``, each prompt's text, which starts each of its choices.
    Raises:
        InvalidRequest: more choices than the capacity or the tenant's ``max_concurrent``.
    """

    def __init__(self, engine: EngineClient, pieces: list[bytes], prompts: list[list[int]],
                 req: GenerationRequest, prompt_param: str, tenant: Tenant = DEFAULT_TENANT,
                 limiter: RateLimiter | None = None, watch_socket=None, sampling: SamplingParams | None = None,
                 grammar_param: str | None = None, new_tool_parser: Callable[[], ToolCallParser] | None = None,
                 echo_texts: list[str] | None = None):
        self.n_choices = check_choices(engine, len(prompts), req.n, tenant)
        self.sampling = req.sampling if sampling is None else sampling
        self.grammar_param, self.new_tool_parser = grammar_param, new_tool_parser
        self.engine, self.prompts, self.prompt_param = engine, prompts, prompt_param
        self.req, self.pieces, self.watch_socket = req, pieces, watch_socket
        self.tenant, self.limiter = tenant, limiter
        self.echo_texts = echo_texts
        #: The tenant's buckets at admission, ``{"requests" | "tokens": (limit, remaining, reset
        #: seconds)}`` (empty: no limits), for the answer's ``x-ratelimit-*`` headers.
        self.rate_buckets: dict = {}
        # What reaches the engine: a scoring request when the prompt's logprobs are asked (it
        # may generate nothing), otherwise nothing at all for max_tokens 0.
        self.kind = RequestKind.SCORE if req.scores else RequestKind.GENERATE
        self.submits = req.max_tokens != 0 or req.scores
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.counts = [0] * self.n_choices  # completion tokens per choice
        # How it went, for telemetry: each choice's finish reason, the exception that ended the
        # output loop (None: its own end), when the first token reached us, and the gaps
        # between consecutive tokens of each choice (seconds).
        self.finish_reasons: list[str | None] = [None] * self.n_choices
        self.tool_calls = [0] * self.n_choices  # calls each choice made
        self.error: BaseException | None = None
        self.first_token_at: float | None = None
        self.token_gaps: list[float] = []
        self._last_token_at: list[float | None] = [None] * self.n_choices
        self.streams: list[Stream] = []
        self._uncharged, self._charged_at = 0, time.monotonic()

    def submit(self) -> Generation:
        """Admit the request and submit its sequences: length first (a request that can never
        run costs no quota), then the tenant's quota, then room in the engine. Returns itself.

        Raises:
            PromptTooLong (naming the prompt's or the max-tokens field) when it does not fit.
            RateLimited: over the tenant's quota or concurrency limit. Saturated,
            EngineUnavailable: no room or no engine. Nothing stays submitted, and a refused
            request is refunded to its tenant's buckets.
        """
        req, tenant, limiter = self.req, self.tenant, self.limiter
        cost = req.n * self.prompt_tokens if self.submits else 0  # prefill the engine will do
        # a scoring request that generates nothing is the one kind with max_new_tokens 0
        sampling = dataclasses.replace(self.sampling, max_new_tokens=0) if req.max_tokens == 0 and req.scores \
            else self.sampling
        admitted = False
        try:
            for prompt in self.prompts:
                self.engine.check(prompt, sampling, self.kind)
            if limiter is not None:
                self.rate_buckets = limiter.admit(tenant, cost).buckets
                admitted = True
            share = tenant.share(req.priority)
            for prompt in self.prompts if self.submits else ():
                for j in range(req.n):
                    params = sampling
                    if params.seed is not None and j:  # one seed would make every choice the same
                        params = dataclasses.replace(params, seed=reduce_seed(params.seed + j))
                    self.streams.append(self.engine.submit(prompt, params, deadline_ms=req.deadline_ms,
                                                           watch_socket=self.watch_socket, kind=self.kind,
                                                           **share._asdict()))
        except BaseException as e:
            self.close()  # nothing stays submitted
            if admitted:
                limiter.refund(tenant, cost)
            if isinstance(e, PromptTooLong):
                e.param = req.max_tokens_param if e.max_new_tokens is not None else self.prompt_param
            elif isinstance(e, InvalidRequest) and e.param == "prompt":
                e.param = self.prompt_param
            elif isinstance(e, InvalidRequest) and e.param == "grammar":
                e.param = self.grammar_param
            raise
        return self

    def deltas(self, keepalive_s: float | None = None) -> Iterator[Delta | None]:
        """Deltas of every choice as they come; each choice ends with one ``finish_reason``.
        With ``keepalive_s``, None is yielded whenever that long passed without a delta (queued,
        or in a long prefill), so a stream can show it is alive.

        Raises:
            ClientDisconnected: the client left (every choice was cancelled).
            EngineUnavailable: the engine failed meanwhile.
        """
        if not self.submits:
            self.finish_reasons = ["length"] * self.n_choices
            yield from (Delta(k, self._echo_text(k), [], "length") for k in range(self.n_choices))
            return
        parsers = [self._tool_parser() for _ in self.streams]
        # Stop strings end the text the client sees: with a tool parser, its visible text, never
        # the envelope or a call's arguments (a stop matched inside them cut the arguments, and
        # the answer still said tool_calls).
        detoks = [Detokenizer(self.pieces, [] if p else self.req.stop) for p in parsers]
        stops = [StopStrings(self.req.stop) if p else None for p in parsers]
        ended = [False] * len(self.streams)
        echoed = [not self.req.echo] * len(self.streams)
        try:
            for k, tokens in follow(self.streams, self.watch_socket, keepalive_s):
                if k < 0:
                    yield None
                    continue
                self._charge(len(tokens))
                if ended[k]:
                    continue  # a stop string ended it; its cancellation is being followed
                if not echoed[k]:  # the prompt comes first, once it is scored (before any token)
                    echoed[k] = True
                    yield self._echo(k)
                self._arrived(k, len(tokens))
                parser = parsers[k]
                for token in tokens:
                    self.counts[k] += 1
                    text, calls = detoks[k].push(token.id), []
                    if parser is not None:
                        text, calls = parser.feed(text)
                        text = stops[k].push(text)
                    if text or calls or token.logprob is not None:
                        yield Delta(k, text, [token], tool_calls=calls)
                    if detoks[k].stopped or (parser is not None and (parser.done or stops[k].stopped)):
                        self.streams[k].cancel()
                        ended[k] = True
                        yield self._finish(k, "", parser, "stop", stops[k])
                        break
                else:
                    if self.streams[k].finished:
                        ended[k] = True
                        yield self._finish(k, detoks[k].flush(), parser, self.streams[k].finish_reason, stops[k])
        except BaseException as e:  # GeneratorExit too: the reader stopped (a stream's client left)
            if isinstance(e, ConstraintFailed):
                e.param = self.grammar_param
            self.error = e
            raise
        finally:
            self.close()

    def _echo_text(self, k: int) -> str:
        return self.echo_texts[k // self.req.n] if self.req.echo else ""

    def _echo(self, k: int) -> Delta:
        """Choice ``k``'s prompt as its first delta: its text and, when scored, one entry per
        prompt token (the first without a log-probability)."""
        prompt = self.prompts[k // self.req.n]
        tokens = self.streams[k].prompt_logprobs(prompt) if self.req.scores else []
        return Delta(k, self._echo_text(k), tokens, echo=True)

    def _tool_parser(self) -> ToolCallParser | None:
        return self.new_tool_parser() if self.new_tool_parser is not None else None

    def _finish(self, k: int, text: str, parser: ToolCallParser | None, reason: str,
                stops: StopStrings | None = None) -> Delta:
        """Choice ``k``'s last delta: the rest of its text (read for calls to the end, ``stops``
        applied to what is visible), and its finish reason, ``tool_calls`` when it made calls
        and stopped (OpenAI's)."""
        calls = []
        if parser is not None:
            text, calls = parser.feed(text, final=True)
            if stops is not None:  # nothing more after a stop string
                text = stops.push(text) + stops.flush()
                reason = "stop" if stops.stopped else reason
            self.tool_calls[k] = parser.n_calls
            if parser.n_calls and reason == "stop":
                reason = "tool_calls"
        self.finish_reasons[k] = reason
        return Delta(k, text, [], reason, calls)

    def _arrived(self, k: int, n_tokens: int) -> None:
        """Note ``n_tokens`` tokens of choice ``k`` arriving now. Tokens that arrive together
        (the reader fell behind) share the gap since the previous arrival."""
        if not n_tokens:
            return
        now = time.monotonic()
        last, self._last_token_at[k] = self._last_token_at[k], now
        if last is None:
            if self.first_token_at is None:
                self.first_token_at = now
            n_tokens -= 1
            last = now
        self.token_gaps.extend([(now - last) / max(1, n_tokens)] * n_tokens)

    def collect(self) -> list[Choice]:
        """Run every choice to its end and close. Raises as :meth:`deltas`."""
        choices = [Choice() for _ in range(self.n_choices)]
        texts = [[] for _ in range(self.n_choices)]
        for d in self.deltas():
            choice = choices[d.index]
            texts[d.index].append(d.text)
            choice.tokens.extend(d.tokens)
            choice.prompt_entries += len(d.tokens) if d.echo else 0
            choice.finish_reason = d.finish_reason or choice.finish_reason
            for c in d.tool_calls:  # the same pieces a stream sends, joined
                if c.id is not None:
                    choice.tool_calls.append(ToolCall(c.id, c.name, ""))
                choice.tool_calls[c.index].arguments += c.arguments
        for choice, text in zip(choices, texts):
            choice.text = "".join(text)
        return choices

    def _charge(self, tokens: int, final: bool = False) -> None:
        """Charge generated tokens to the tenant's token bucket, aggregated (see
        :data:`CHARGE_EVERY_TOKENS`)."""
        if self.limiter is None or self.tenant.tokens_per_second is None:
            return
        self._uncharged += tokens
        now = time.monotonic()
        if self._uncharged and (final or self._uncharged >= CHARGE_EVERY_TOKENS
                                or now - self._charged_at >= CHARGE_EVERY_S):
            self.limiter.charge(self.tenant, self._uncharged)
            self._uncharged, self._charged_at = 0, now

    def close(self) -> None:
        """Cancel every unfinished choice, then wait for each and release it, and charge what
        is left to charge (idempotent)."""
        for s in self.streams:
            if not s.finished:
                s.cancel()
        for s in self.streams:
            s.close()
        self._charge(0, final=True)

    def usage(self) -> Usage:
        """Prompt tokens counted once per prompt, and as cached those the prefix cache gave every
        choice of their prompt (the smallest reuse among a prompt's ``n`` choices). Read after
        :meth:`close`."""
        n = self.req.n
        cached = sum(min(s.n_cached for s in self.streams[i:i + n]) for i in range(0, len(self.streams), n))
        return Usage(self.prompt_tokens, sum(self.counts), cached)

    def timings(self, choice: int = 0) -> Timings:
        """The engine's timings of one choice's sequence (choice 0 by default)."""
        return self.streams[choice].timings()


class Generator:
    """Starts generations from text: what every front end needs (engine client, tokenizer,
    chat template, rate limiter), built once per process.

    Args:
        engine: the engine client. tokenizer: the served model's. template: its chat template.
        limiter: tenants' rate limits (None: no limits).
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, template: ChatTemplate,
                 limiter: RateLimiter | None = None):
        self.engine, self.tokenizer, self.template, self.limiter = engine, tokenizer, template, limiter
        self.grammars = CheckedGrammars()
        #: How the template's model writes tool calls (``server/tools/formats.py``).
        self.tool_format = detect(template.source, template.takes_tools)
        #: Its fixed texts that are one special token here, and the pieces a tool-calling
        #: answer is read with: those tokens as their text (a control token is otherwise no
        #: text at all, and the parser would never see ``[TOOL_CALLS]``).
        self.tool_specials: dict[str, int] = {}
        for text in self.tool_format.literals:
            ids = tokenizer.encode(text, special=True) if text in tokenizer.special_texts else []
            if len(ids) == 1:
                self.tool_specials[text] = ids[0]
        self.tool_pieces = list(tokenizer.pieces) if self.tool_specials else tokenizer.pieces
        for text, token in self.tool_specials.items():
            self.tool_pieces[token] = text.encode()

    def chat(self, messages: list[dict], req: GenerationRequest, prompt_param: str = "messages",
             render: dict | None = None, **submit) -> Generation:
        """``messages`` (``server.api.requests.parse_messages``'s) rendered with the chat
        template (``render``: :meth:`ChatTemplate.encode`'s options), with the request's tools
        (a template that takes ``tools`` gets them; otherwise the generic format's system
        message describes them; ``tool_choice: "none"`` gives none). ``submit``: ``tenant``,
        ``watch_socket``. Raises as :class:`Generation` and :meth:`Generation.submit`, and
        :class:`InvalidRequest` for a structured output on a continued final message, or one
        that tools cannot be combined with."""
        render = render or {}
        self._check_logit_bias(req)
        constraint = req.constraint
        if constraint is not None and render.get("continue_final_message"):
            # the grammar would hold the continuation alone, not the message it continues
            raise InvalidRequest(f"continue_final_message cannot be combined with {constraint.param} (send "
                                 "add_generation_prompt: true for a new assistant turn)", "continue_final_message")
        tools = req.tools if req.tools is not None and req.tools.choice != NONE else None
        tenant = submit.get("tenant", DEFAULT_TENANT)
        if tools is None:
            sampling, grammar_param = self._constrained(req, tenant)
        else:
            sampling, grammar_param = self._with_tools(req, tools, tenant)
        json_answer = tools is not None and constraint is not None  # an answer is a document of the format
        offered = tools.tools if tools is not None else ()
        ids = self.prompt_ids(messages, offered, render, json_answer=json_answer, prompt_param=prompt_param)
        new_tool_parser = None if tools is None else functools.partial(
            ToolCallParser, self.tool_format, None if tools.parallel else 1, tools.calls_only, json_answer)
        return Generation(self.engine, self.tool_pieces if offered else self.tokenizer.pieces, [ids], req,
                          prompt_param, limiter=self.limiter, sampling=sampling, grammar_param=grammar_param,
                          new_tool_parser=new_tool_parser, **submit).submit()

    def prompt_ids(self, messages: list[dict], offered: tuple[Tool, ...] = (), render: dict | None = None,
                   json_answer: bool = False, prompt_param: str = "messages") -> list[int]:
        """The prompt tokens of ``messages`` (``server.api.requests.parse_messages``'s) with the
        tools ``offered``, as the template's tool format renders them
        (:meth:`server.tools.formats.ToolFormat.prompt_messages`: a template that takes
        ``tools`` gets them and renders the history's calls itself; the generic format's
        messages otherwise, calls and results as text). The one rendering of a chat, for
        generation and ``POST /tokenize`` alike. ``render``: :meth:`ChatTemplate.encode`'s
        options; ``json_answer``: an answer that is not a call follows a JSON format.

        Raises:
            InvalidRequest: ``continue_final_message`` with tools offered (a call's grammar
                starts where an answer starts), or the template refuses the conversation
                (:meth:`ChatTemplate.render`).
            PromptTooLong: naming ``prompt_param``, for a chat that cannot fit one sequence,
                found before rendering (:meth:`_fits_at_all`; with the generic format, the
                indentation its tool description adds counts too: 100 KB of nested schema
                rendered to 400,000 tokens in 8 s).
        """
        render = render or {}
        if offered and render.get("continue_final_message"):
            raise InvalidRequest("continue_final_message cannot be combined with tools (use tool_choice: none)",
                                 "continue_final_message")
        fmt = self.tool_format
        texts = [m["content"] or "" for m in messages] + [json.dumps(t.parameters, ensure_ascii=False) for t in offered]
        self._fits_at_all(texts, prompt_param, len(messages) * self.template.tokens_per_message,
                          fmt.prompt_chars(offered) if offered else 0)
        return self.template.encode(fmt.prompt_messages(messages, offered, json_answer),
                                    tools=fmt.template_tools(offered), **render)

    def _check_logit_bias(self, req: GenerationRequest) -> None:
        """Every token ``logit_bias`` names is in the vocabulary.

        Raises:
            InvalidRequest: naming ``logit_bias``.
        """
        outside = [t for t, _ in req.sampling.logit_bias if t >= self.tokenizer.n_vocab]
        if outside:
            raise InvalidRequest(f"logit_bias names token id {outside[0]}, outside the vocabulary "
                                 f"(0..{self.tokenizer.n_vocab - 1})", "logit_bias")

    def _constrained(self, req: GenerationRequest, tenant: Tenant) -> tuple[SamplingParams, str | None]:
        """The request's sampling with the grammar of its structured output alone, and the
        field that grammar's failures name (None: unconstrained). The grammar fits the
        record's variable section and compiles within llguidance's limits
        (``server.structured.check``, memoized per tenant), so the engine never sees one that
        does not.

        Raises:
            InvalidRequest: naming the constraint's field, with the library's message.
        """
        constraint = req.constraint
        if constraint is None:
            return req.sampling, None
        sampling = self._fitting(req, constraint.grammar(), constraint.param)
        error = self.grammars.check(tenant.index, sampling.grammar, text_only=True)
        if error:
            raise InvalidRequest(f"{constraint.param} cannot be enforced: {error}", constraint.param)
        return sampling, constraint.param

    def _with_tools(self, req: GenerationRequest, tools: ToolRequest, tenant: Tenant) -> tuple[SamplingParams, str]:
        """The request's sampling with the grammar of a tool-calling answer
        (``server/tools/grammar.py``), its JSON format inlined where an answer is not a call;
        its failures name ``tools``. The format's and each callable function's schema are
        checked together, each fault named by its own field (``server.tools.grammar.
        checked_arguments``); the grammar, written from them, is not checked again.

        Raises:
            InvalidRequest: a format that is not JSON (no place for a call beside it), a format
                this model's tool syntax cannot hold beside calls, a schema that cannot be
                enforced (naming its field), a grammar over the variable section.
        """
        constraint = req.constraint
        if constraint is not None and constraint.schema is None:  # a regex, a choice, Lark
            raise InvalidRequest(f"tools can be combined with a JSON format only, not with {constraint.param}",
                                 constraint.param)
        arguments = checked_arguments(tools, constraint, lambda schemas: self.grammars.check_schemas(tenant.index,
                                                                                                     schemas))
        content = constraint.schema if constraint is not None else None
        try:
            grammar = tool_grammar(self.tool_format, tools, self.tool_specials, content, arguments)
        except ValueError as e:  # this model's tool format cannot hold a JSON answer
            raise InvalidRequest(f"tools cannot be combined with {constraint.param} here: {e}",
                                 constraint.param) from None
        return self._fitting(req, grammar, "tools"), "tools"

    def _fitting(self, req: GenerationRequest, grammar: str, param: str) -> SamplingParams:
        """``req.sampling`` with ``grammar``, which fits the record's variable section.

        Raises:
            InvalidRequest: naming ``param``; with tools, the format's own field when the
                format alone would not fit either.
        """
        sampling = dataclasses.replace(req.sampling, grammar=grammar)
        try:
            sampling.check_extras(self.engine.max_extras_bytes)
        except InvalidRequest as e:
            constraint = req.constraint
            if param == "tools" and constraint is not None:
                try:
                    dataclasses.replace(req.sampling, grammar=constraint.grammar()).check_extras(
                        self.engine.max_extras_bytes)
                except InvalidRequest:
                    param = constraint.param
            raise InvalidRequest(e.message, param) from None
        return sampling

    def _fits_at_all(self, texts: list[str], prompt_param: str, template_tokens: int = 0, chars: int = 0) -> None:
        """Refuse, before rendering or tokenizing, text that cannot fit one sequence: a token holds
        at most ``max_piece_bytes`` bytes and a character is at least one byte, so C characters
        are at least C / ``max_piece_bytes`` tokens. A body that will be refused costs little CPU.

        ``template_tokens``: tokens the chat template adds for sure (per message); ``chars``:
        characters the rendering adds for sure beyond ``texts``.

        Raises:
            PromptTooLong: naming ``prompt_param`` and the lower bound.
        """
        at_least = template_tokens + -(-(chars + sum(len(t) for t in texts)) // self.tokenizer.max_piece_bytes)
        if at_least > self.engine.max_seq_len - 1:
            raise PromptTooLong(at_least, self.engine.max_seq_len, at_least=True, param=prompt_param)

    def complete(self, prompts: list[str | list[int]], req: GenerationRequest, prompt_param: str = "prompt",
                 **submit) -> Generation:
        """Plain-text prompts (BOS added if the model wants it) or token-id prompts (used as
        they are); with ``req.echo``, each choice starts with its prompt's text (token ids
        detokenized). Raises as :class:`Generation` and :meth:`Generation.submit`; InvalidRequest
        for a token id outside the vocabulary."""
        check_choices(self.engine, len(prompts), req.n, submit.get("tenant", DEFAULT_TENANT))  # before tokenizing
        self._check_logit_bias(req)
        sampling, grammar_param = self._constrained(req, submit.get("tenant", DEFAULT_TENANT))
        self._fits_at_all([p for p in prompts if isinstance(p, str)], prompt_param)
        ids = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                # Control-token text is that token, as /tokenize, OpenAI's API, vLLM and llama-server
                # read a raw prompt (lm-eval counts a context with /tokenize, then slices the echo by
                # that count). An empty prompt starts a new document (OpenAI's default).
                ids.append(self.tokenizer.encode(prompt, special=True, add_bos=True)
                           or self.tokenizer.encode(DOCUMENT_START, special=True, add_bos=True))
            else:
                check_prompt_fits(len(prompt), self.engine.max_seq_len, prompt_param)  # before the O(n) id check
                if any(not 0 <= t < self.tokenizer.n_vocab for t in prompt):
                    raise InvalidRequest(f"{prompt_param}[{i}] holds a token id outside "
                                         f"0..{self.tokenizer.n_vocab - 1}", prompt_param)
                ids.append(list(prompt))
        # a text prompt echoed as given; token ids (and an empty prompt's new document) as their
        # text, control tokens written out but the BOS a model's tokenizer adds (a text prompt's
        # echo lacks it), so the echo is what the prompt's tokens spell
        added = [self.tokenizer.bos] if self.tokenizer.add_bos else []
        echo_texts = [p if isinstance(p, str) and p else
                      self.tokenizer.decode(i[len(added):] if added and i[:1] == added else i, special=True)
                      for p, i in zip(prompts, ids)] if req.echo else None
        return Generation(self.engine, self.tokenizer.pieces, ids, req, prompt_param, limiter=self.limiter,
                          sampling=sampling, grammar_param=grammar_param, echo_texts=echo_texts, **submit).submit()
