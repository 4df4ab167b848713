"""Chat prompts: the GGUF's ``tokenizer.chat_template`` rendered with Jinja2 in a sandbox.

Message text is data, never template code, and special-token text inside it (``<|im_start|>``)
must stay plain text. So the template is rendered with a random placeholder in place of each
message's text; the rendered template pieces are tokenized with special tokens parsed, the
message texts without, and the ids are concatenated in order.
"""
from __future__ import annotations

import secrets

from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequest
from engine.llama.tokenizer import Tokenizer

# Roles as the template sees them: OpenAI's "developer" is the system role of older models.
ROLE_ALIASES = {"developer": "system"}


class ChatTemplate:
    """Renders and tokenizes a list of ``{"role", "content"}`` messages (content: str).

    Raises (from ``__init__``):
        ValueError: the model has no chat template, or it does not compile.
    """

    def __init__(self, tokenizer: Tokenizer, source: str | None = None):
        source = source or tokenizer.chat_template
        if not source:
            raise ValueError("the model has no chat template (tokenizer.chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.source = source  #: the Jinja text (served by GET /tokenizer_info)
        self.tokenizer = tokenizer
        #: Tokens the template adds for each message at least (a cheap lower bound on a prompt).
        self.tokens_per_message = max(0, min(self._added_tokens(r) for r in ("system", "user", "assistant")))

    def _added_tokens(self, role: str) -> int:
        """Tokens one more empty ``role`` message adds; 0 (no bound) when the template refuses two
        such messages in a row (Mistral's and Gemma's: roles must alternate)."""
        m = [{"role": role, "content": ""}]
        try:
            return len(self.encode(m * 2, False)) - len(self.encode(m, False))
        except InvalidRequest:
            return 0

    def encode(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> list[int]:
        """Prompt token ids for ``messages``.

        Args:
            add_generation_prompt: end with the opening of a new assistant turn.
            continue_final_message: end right after the final message's text (an assistant
                message the model continues, as llama.cpp's server and vLLM's
                ``continue_final_message`` do): whatever the template renders after it (the
                end of that turn) is dropped. Needs ``add_generation_prompt`` False.

        Raises:
            InvalidRequest: the template refuses the messages (its ``raise_exception``).
        """
        tag = secrets.token_hex(8)
        marked = [{"role": ROLE_ALIASES.get(m["role"], m["role"]), "content": f"\x00{tag}:{i}\x00"}
                  for i, m in enumerate(messages)]
        rendered = self.template.render(messages=marked, add_generation_prompt=add_generation_prompt,
                                        bos_token="", eos_token="")
        # [text, index, text, index, ..., text], what re.split with a capturing group gives,
        # without compiling (and caching) a pattern per request.
        chunks = rendered.split(f"\x00{tag}:")
        parts = [chunks[0]]
        for chunk in chunks[1:]:
            index, _, text = chunk.partition("\x00")
            parts += [index, text]
        if continue_final_message:
            parts = parts[:-1]  # the template text after the final message's text
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids += self.tokenizer.encode(messages[int(part)]["content"], special=False)
            elif part:
                ids += self.tokenizer.encode(part, special=True, add_bos=(k == 0))
        return ids


def _raise(message: str):
    """The template's ``raise_exception``: it refuses these messages (roles out of order, a role
    it has no rendering for), a client error (400), not a server one."""
    raise InvalidRequest(message, "messages")
