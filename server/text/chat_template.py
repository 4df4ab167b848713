"""Chat prompts: the GGUF's ``tokenizer.chat_template`` (or ``--chat-template FILE``) rendered
with Jinja2 in a sandbox, in the environment Hugging Face's ``apply_chat_template`` gives it
(``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``, loop controls), so a
template renders here what it renders there.

Message text is data, never template code, and special-token text inside it (``<|im_start|>``)
must stay plain text. So the template is rendered with a random placeholder in place of each
message's text, and of each string in the tools and in earlier tool calls that holds
special-token text; the rendered template pieces are tokenized with special tokens parsed, the
data without, and the ids are concatenated in order. A placeholder holds a newline, so where a
template wrote it through ``tojson`` it shows as ``\\n``, and that datum is put in JSON-escaped.
"""
from __future__ import annotations

import datetime
import json
import re
import secrets

import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequest
from engine.llama.tokenizer import Tokenizer

# Roles as the template sees them: OpenAI's "developer" is the system role of older models.
ROLE_ALIASES = {"developer": "system"}


def environment() -> ImmutableSandboxedEnvironment:
    """Hugging Face's chat-template environment (transformers' ``_compile_jinja_template``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """Renders and tokenizes a list of messages (``{"role", "content": str | None}``, with
    Hugging Face's tool fields: ``tool_calls`` whose ``arguments`` are objects,
    ``tool_call_id``, ``name``), and the request's ``tools`` when the template takes them.

    A template without a system role (Gemma's: it raises on one, or renders nothing of it) gets a
    leading system message merged into the next message, its text first and a newline between
    (llama.cpp's ``system_message_not_supported`` workaround in ``common/chat.cpp``, on the same
    test: does a system message's text appear in the rendering?), so OpenAI clients' system
    prompts and the generic tool format's instructions reach such a model as they reach it
    through llama-server.

    Attributes:
        source: the template's Jinja source. takes_tools: it reads the ``tools`` variable.
        system_role: it renders a system message.
    Raises (from ``__init__``):
        ValueError: no ``source`` is given and the model has no chat template.
        jinja2.TemplateSyntaxError: it does not compile (the server checks that at start:
            ``ModelSpec.chat_template_origin``).
    """

    def __init__(self, tokenizer: Tokenizer, source: str | None = None):
        source = source or tokenizer.chat_template
        if not source:
            raise ValueError("the model has no chat template (tokenizer.chat_template)")
        env = environment()
        self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self.template = env.from_string(source)
        self.source = source  #: the Jinja text (served by GET /tokenizer_info)
        self.tokenizer = tokenizer
        self.system_role = self._renders_system_role()
        #: Tokens the template adds for each message at least (a cheap lower bound on a prompt).
        self.tokens_per_message = max(0, min(self._added_tokens(r) for r in ("system", "user", "assistant")))

    @classmethod
    def of(cls, tokenizer: Tokenizer, source: str | None = None) -> "ChatTemplate | None":
        """The template a server renders chats with: ``source`` (``--chat-template``'s), else the
        model's; None when the model has none (a base model: it serves no chat, and no format
        is guessed for it)."""
        return cls(tokenizer, source) if source or tokenizer.chat_template else None

    def _renders_system_role(self) -> bool:
        """Whether a system message's text shows in the rendering of ``[system, user]``."""
        probe = f"system-{secrets.token_hex(8)}"
        try:
            text = self.template.render(messages=[{"role": "system", "content": probe},
                                                  {"role": "user", "content": "User message"}],
                                        add_generation_prompt=True, bos_token="", eos_token="")
        except Exception:  # noqa: BLE001 - a template that cannot render one (raise_exception) has none
            return False
        return probe in text

    def _added_tokens(self, role: str) -> int:
        """Tokens one more empty ``role`` message adds; 0 (no bound) when the template refuses two
        such messages in a row (Mistral's and Gemma's: roles must alternate), or cannot render
        empty messages at all (it fails in its own way, which a request would see as well)."""
        m = [{"role": role, "content": ""}]
        try:
            return len(self.encode(m * 2, False)) - len(self.encode(m, False))
        except (InvalidRequest, jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError):
            return 0

    def encode(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               param: str = "messages") -> list[int]:
        """Prompt token ids for ``messages``: :meth:`render`'s pieces, the template's with
        special tokens parsed, the data's without.

        Raises:
            InvalidRequest: naming ``param``, the request field the messages came from: the
                template refuses them (its ``raise_exception``).
        """
        ids: list[int] = []
        for k, part in enumerate(self.render(messages, add_generation_prompt, continue_final_message, tools, param)):
            if k % 2:
                ids += self.tokenizer.encode(part, special=False)
            elif part:
                ids += self.tokenizer.encode(part, special=True, add_bos=(k == 0))
        return ids

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               param: str = "messages") -> list[str]:
        """The prompt's text as ``[template text, datum, template text, ..., template text]``.

        Args:
            add_generation_prompt: end with the opening of a new assistant turn.
            continue_final_message: end right after the final message's text (an assistant
                message the model continues, as llama.cpp's server and vLLM's
                ``continue_final_message`` do): whatever the template renders after it (the
                end of that turn) is dropped. Needs ``add_generation_prompt`` False.
            tools: OpenAI's ``tools`` (``[{"type": "function", "function": {...}}]``), given to
                a template that takes them; None: the variable is left undefined.

        Raises:
            InvalidRequest: naming ``param``: the template refuses the messages (its
                ``raise_exception``).
        """
        if not self.system_role:
            messages = merge_system_message(messages)
        marks = _Marks(self.tokenizer.special_texts)
        marked = []
        for m in messages:
            content = m["content"]
            if content is not None and (content or not m.get("tool_calls")):  # "" beside calls: falsy, as sent
                content = marks.text(content)
            entry = {"role": ROLE_ALIASES.get(m["role"], m["role"]), "content": content}
            entry.update((k, marks.data(m[k])) for k in ("name", "tool_calls", "tool_call_id") if k in m)
            marked.append(entry)
        extra = {"tools": marks.data(tools)} if tools else {}
        try:
            rendered = self.template.render(messages=marked, add_generation_prompt=add_generation_prompt,
                                            bos_token="", eos_token="", **extra)
        except TemplateRefusal as e:
            raise InvalidRequest(str(e), param) from None
        parts = marks.split(rendered)
        return parts[:-1] if continue_final_message else parts  # drop what follows the final text


def merge_system_message(messages: list[dict]) -> list[dict]:
    """``messages`` with a leading system (or developer) message merged into the next one: its
    text, a newline, then that message's. A lone system message stays, for the template to
    refuse (llama.cpp drops it, which would answer a request it never saw)."""
    if len(messages) < 2 or ROLE_ALIASES.get(messages[0]["role"], messages[0]["role"]) != "system":
        return messages
    first, second = messages[0], messages[1]
    merged = f"{first['content'] or ''}\n{second['content'] or ''}"
    return [{**second, "content": merged}, *messages[2:]]


class _Marks:
    """The placeholders of one rendering and the data they stand for."""

    def __init__(self, special_texts: tuple[str, ...]):
        self.tag = secrets.token_hex(8)
        self.special = special_texts
        self.values: list[str] = []

    def text(self, value: str) -> str:
        self.values.append(value)
        return f"\ue000{self.tag}:{len(self.values) - 1}\n\ue001"

    def data(self, value):
        """``value`` (JSON-like) with each string that holds special-token text replaced by a
        placeholder; other strings stay (a template may compare them: ``type == "string"``)."""
        if isinstance(value, str):
            return self.text(value) if any(t in value for t in self.special) else value
        if isinstance(value, dict):
            return {self.data(k): self.data(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.data(v) for v in value]
        return value

    def split(self, rendered: str) -> list[str]:
        """``[text, datum, text, ...]``: each datum as the template wrote it (raw or JSON-escaped)."""
        chunks = re.split(f"\ue000{self.tag}:(\\d+)(\n|\\\\n)\ue001", rendered)
        parts = [chunks[0]]
        for k in range(1, len(chunks), 3):
            value = self.values[int(chunks[k])]
            parts += [value if chunks[k + 1] == "\n" else json.dumps(value, ensure_ascii=False)[1:-1], chunks[k + 2]]
        return parts


class NoChatTemplate(InvalidRequest):
    """A chat (Chat Completions, Responses, gRPC's ``ChatComplete``, ``/tokenize``'s
    ``messages``) to a model without a chat template, a base model served without
    ``--chat-template`` (HTTP 400, gRPC INVALID_ARGUMENT). No turn format is guessed for it: a
    wrong one makes a model answer worse than a plain prompt does. ``param``: the field that
    holds the conversation."""

    code = "chat_template_missing"

    def __init__(self, param: str):
        super().__init__("this model has no chat template (its GGUF file has no tokenizer.chat_template), so it "
                         "serves no chat: start the server with --chat-template FILE (with several models, chat_template "
                         "in the models file), a Jinja chat template of the model's turn format, or send a plain "
                         "prompt to /v1/completions", param)


class TemplateRefusal(Exception):
    """The template's ``raise_exception``: it refuses these messages (roles out of order, a role
    it has no rendering for), a client error (400) that :meth:`ChatTemplate.render` names by the
    request field the messages came from."""


def _raise(message: str):
    raise TemplateRefusal(message)
