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
from typing import TYPE_CHECKING

from engine.client import EngineClient
from engine.errors import InvalidRequest, PromptTooLong
from engine.request import FieldNames, SamplingParams, check_prompt_fits
from engine.llama.tokenizer import Tokenizer
from server.generation.generation import Generation
from server.generation.request import GenerationRequest
from server.generation.submission import check_choices
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import DEFAULT_TENANT, Tenant
from server.text.chat_template import ChatTemplate, NoChatTemplate
from server.structured.check import CheckedGrammars
from server.structured.schema import SEPARATORS
from server.tools.formats import GENERIC, detect
from server.tools.grammar import checked_arguments, tool_grammar
from server.tools.parser import ToolCallParser
from server.tools.spec import NONE, Tool, ToolRequest

if TYPE_CHECKING:  # injected by the front ends; the control plane imports the request schema
    from server.control.accounting import Accounting

#: The text of OpenAI's default prompt: the document separator, a new document's start.
DOCUMENT_START = "<|endoftext|>"


class Generator:
    """Starts generations from text: what every front end needs (engine client, tokenizer,
    chat template, rate limiter), built once per process.

    Args:
        engine: the engine client. tokenizer: the served model's. template: its chat template
            (:meth:`ChatTemplate.of`); None: it has none (a base model), and every chat is
            refused (:class:`NoChatTemplate`) while completions, scoring and ``/infer`` serve.
        limiter: tenants' rate limits (None: no limits). accounting: projects' spend and usage
            (``server/control/accounting.py``; None: not recorded).
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, template: ChatTemplate | None,
                 limiter: RateLimiter | None = None, accounting: Accounting | None = None,
                 separators: tuple[str, str] = SEPARATORS):
        self.engine, self.tokenizer, self.template, self.limiter = engine, tokenizer, template, limiter
        self.accounting = accounting
        self.separators = separators  # the model's JSON separators (its spec's json_separators)
        self.grammars = CheckedGrammars()
        #: How the template's model writes tool calls (``server/tools/formats.py``); without a
        #: template, no tools are offered (no chat is), and this is never read.
        self.tool_format = detect(template.source, template.takes_tools) if template is not None else GENERIC
        #: Its fixed texts that are one special token here, and the pieces a tool-calling
        #: answer is read with: those tokens as their text (a control token is otherwise no
        #: text at all, and the parser would never see ``[TOOL_CALLS]``).
        self.tool_specials: dict[str, int] = {}
        for text in self.tool_format.literals if template is not None else ():
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
        that tools cannot be combined with; :class:`NoChatTemplate` (naming ``prompt_param``)
        when the model has no chat template, before anything else is checked."""
        self.chat_template(prompt_param)
        render = render or {}
        self._check_logit_bias(req)
        req = self.laid_out(req)
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
                          prompt_param, limiter=self.limiter, accounting=self.accounting, sampling=sampling,
                          grammar_param=grammar_param,
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
            NoChatTemplate: naming ``prompt_param``: the model has no chat template.
            InvalidRequest: ``continue_final_message`` with tools offered (a call's grammar
                starts where an answer starts), or the template refuses the conversation
                (:meth:`ChatTemplate.render`).
            PromptTooLong: naming ``prompt_param``, for a chat that cannot fit one sequence,
                found before rendering (:meth:`_fits_at_all`; with the generic format, the
                indentation its tool description adds counts too: 100 KB of nested schema
                rendered to 400,000 tokens in 8 s).
        """
        template = self.chat_template(prompt_param)
        render = render or {}
        if offered and render.get("continue_final_message"):
            raise InvalidRequest("continue_final_message cannot be combined with tools (use tool_choice: none)",
                                 "continue_final_message")
        fmt = self.tool_format
        texts = [m["content"] or "" for m in messages] + [json.dumps(t.parameters, ensure_ascii=False) for t in offered]
        self._fits_at_all(texts, prompt_param, len(messages) * template.tokens_per_message,
                          fmt.prompt_chars(offered) if offered else 0)
        return template.encode(fmt.prompt_messages(messages, offered, json_answer),
                               tools=fmt.template_tools(offered), param=prompt_param, **render)

    def chat_template(self, prompt_param: str) -> ChatTemplate:
        """The chat template. The chat routes ask for it before they parse a body, so a chat to
        a model without one gets that refusal, not a field's; :meth:`chat` and
        :meth:`prompt_ids` ask again (``/tokenize``'s ``messages`` and ``/infer`` come through
        them alone).

        Raises:
            NoChatTemplate: naming ``prompt_param``: the model has none.
        """
        if self.template is None:
            raise NoChatTemplate(prompt_param)
        return self.template

    def infer(self, payload: str, req: GenerationRequest, **submit) -> Generation:
        """``/infer``'s generation (HTTP and gRPC): ``payload`` as the user's message of a chat,
        or, for a model without a chat template, as a plain prompt the model continues (a base
        model's way to answer). Raises as :meth:`chat` and :meth:`complete`, naming
        ``payload``."""
        if self.template is None:
            return self.complete([payload], req, "payload", **submit)
        return self.chat([{"role": "user", "content": payload}], req, "payload", **submit)

    def _check_logit_bias(self, req: GenerationRequest) -> None:
        """Every token ``logit_bias`` names is in the vocabulary.

        Raises:
            InvalidRequest: naming ``logit_bias``.
        """
        outside = [t for t, _ in req.sampling.logit_bias if t >= self.tokenizer.n_vocab]
        if outside:
            raise InvalidRequest(f"logit_bias names token id {outside[0]}, outside the vocabulary "
                                 f"(0..{self.tokenizer.n_vocab - 1})", "logit_bias")

    def laid_out(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with its JSON constraint written with this model's separators (where its
        schema names no layout of its own)."""
        constraint = req.constraint
        if constraint is None or constraint.separators == self.separators:
            return req
        return dataclasses.replace(req, constraint=dataclasses.replace(constraint, separators=self.separators))

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
        limit, constraint = self.engine.max_extras_bytes, req.constraint
        if param == "tools" and constraint is not None and len(sampling.extras_bytes()) > limit:
            alone = dataclasses.replace(req.sampling, grammar=constraint.grammar())
            if len(alone.extras_bytes()) > limit:  # the format would not fit without the tools either
                param = constraint.param
        sampling.check_extras(limit, FieldNames(grammar=param))
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
        sampling, grammar_param = self._constrained(self.laid_out(req), submit.get("tenant", DEFAULT_TENANT))
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
                          accounting=self.accounting, sampling=sampling, grammar_param=grammar_param, echo_texts=echo_texts, **submit).submit()
