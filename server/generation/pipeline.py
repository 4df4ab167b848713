"""The front-end-neutral request path, shared by the HTTP and the gRPC front end:

    render/tokenize (:class:`Generator`) -> :class:`~server.generation.generation.Generation`:
    prepare, admit and submit n sequences (``server/generation/submission.py``) -> follow their
    tokens, each choice read by its ``ChoiceState`` (``server/generation/choice.py``) -> usage
    and timings

No HTTP or gRPC type appears here: errors are those of :mod:`engine.errors`, mapped to both
protocols in one place (``server/errors.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import json

from engine.client import EngineClient
from engine.errors import InvalidRequest, PromptTooLong
from engine.llama.grammar import CheckedGrammars, json_schema_of
from engine.request import check_prompt_fits
from engine.llama.tokenizer import Tokenizer
from server.generation.generation import Generation
from server.generation.request import GenerationRequest
from server.generation.submission import check_choices
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import DEFAULT_TENANT, Tenant
from server.text.chat_template import ChatTemplate
from server.tools.formats import detect, generic_indentation, generic_messages
from server.tools.grammar import check_parameters, tool_grammar
from server.tools.parser import ToolCallParser
from server.tools.spec import NAMED, NONE, REQUIRED, Tool

#: The text of OpenAI's default prompt: the document separator, a new document's start.
DOCUMENT_START = "<|endoftext|>"
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
        :class:`InvalidRequest` for a structured output on a continued final message."""
        render = render or {}
        self._check_logit_bias(req)
        if req.grammar_param is not None and render.get("continue_final_message"):
            # the grammar would hold the continuation alone, not the message it continues
            raise InvalidRequest(f"continue_final_message cannot be combined with {req.grammar_param} (send "
                                 "add_generation_prompt: true for a new assistant turn)", "continue_final_message")
        offered = req.tools.tools if req.tools is not None and req.tools.choice != NONE else ()
        tenant = submit.get("tenant", DEFAULT_TENANT)
        content = None  # the JSON format an answer that is not a call must follow
        if offered:
            if req.sampling.grammar is not None:
                content = json_schema_of(req.sampling.grammar)
                if content is None:  # a regex, a choice, Lark: it leaves no place for a call
                    raise InvalidRequest(f"tools can be combined with a JSON format only, not with "
                                         f"{req.grammar_param}", req.grammar_param)
                self._check_grammar(req, tenant)  # the format alone first: its faults name its field
            # then each function's, by name (the whole grammar's message would name only tools)
            check_parameters(req.tools, lambda g: self.grammars.check(tenant.index, g, text_only=True))
            try:
                grammar = tool_grammar(self.tool_format, req.tools, self.tool_specials, content)
            except ValueError as e:  # this model's tool format cannot hold a JSON answer
                raise InvalidRequest(f"tools cannot be combined with {req.grammar_param} here: {e}",
                                     req.grammar_param) from None
            req.sampling = dataclasses.replace(req.sampling, grammar=grammar)
            req.grammar_param = "tools"
        self._check_grammar(req, tenant)
        ids = self.prompt_ids(messages, offered, render, json_answer=content is not None, prompt_param=prompt_param)
        new_tool_parser = None
        if offered:  # a parser per choice, reading one call at most unless parallel calls are allowed
            tool_format = dataclasses.replace(self.tool_format, json_answer=content is not None)
            new_tool_parser = functools.partial(ToolCallParser, tool_format, None if req.tools.parallel else 1,
                                                calls_only=req.tools.choice in (REQUIRED, NAMED))
        return Generation(self.engine, self.tool_pieces if offered else self.tokenizer.pieces, [ids], req,
                          prompt_param, limiter=self.limiter, sampling=req.sampling, grammar_param=req.grammar_param,
                          new_tool_parser=new_tool_parser, **submit).submit()

    def prompt_ids(self, messages: list[dict], offered: tuple[Tool, ...] = (), render: dict | None = None,
                   json_answer: bool = False, prompt_param: str = "messages") -> list[int]:
        """The prompt tokens of ``messages`` (``server.api.requests.parse_messages``'s) with the
        tools ``offered``: a template that takes ``tools`` gets them and renders the history's
        calls itself; any other renders :func:`server.tools.formats.generic_messages` (calls and
        results as text). The one rendering of a chat, for generation and ``POST /tokenize``
        alike. ``render``: :meth:`ChatTemplate.encode`'s options; ``json_answer``: an answer
        that is not a call follows a JSON format.

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
        texts = [m["content"] or "" for m in messages] + [json.dumps(t.parameters, ensure_ascii=False) for t in offered]
        indentation = generic_indentation(offered) if offered and not self.tool_format.native else 0
        self._fits_at_all(texts, prompt_param, len(messages) * self.template.tokens_per_message, indentation)
        if self.tool_format.native:
            return self.template.encode(messages, tools=[t.openai() for t in offered] or None, **render)
        return self.template.encode(generic_messages(messages, offered, json_answer=json_answer), **render)

    def _check_logit_bias(self, req: GenerationRequest) -> None:
        """Every token ``logit_bias`` names is in the vocabulary.

        Raises:
            InvalidRequest: naming ``logit_bias``.
        """
        outside = [t for t, _ in req.sampling.logit_bias if t >= self.tokenizer.n_vocab]
        if outside:
            raise InvalidRequest(f"logit_bias names token id {outside[0]}, outside the vocabulary "
                                 f"(0..{self.tokenizer.n_vocab - 1})", "logit_bias")

    def _check_grammar(self, req: GenerationRequest, tenant: Tenant) -> None:
        """The request's grammar fits the record's variable section, then compiles within
        llguidance's limits (``engine.llama.grammar.check``, memoized per tenant), so the engine
        never sees one that does not.

        Raises:
            InvalidRequest: naming ``req.grammar_param``, with the library's message.
        """
        grammar = req.sampling.grammar
        if grammar is None:
            return
        try:
            req.sampling.check_extras(self.engine.max_extras_bytes)
        except InvalidRequest as e:
            e.param = req.grammar_param
            raise
        error = self.grammars.check(tenant.index, grammar, text_only=req.grammar_param != "tools")
        if error:
            raise InvalidRequest(f"{req.grammar_param} cannot be enforced: {error}", req.grammar_param)

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
        self._check_grammar(req, submit.get("tenant", DEFAULT_TENANT))
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
                          echo_texts=echo_texts, sampling=req.sampling, grammar_param=req.grammar_param,
                          **submit).submit()
