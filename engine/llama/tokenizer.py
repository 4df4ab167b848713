"""Front-end tokenizer: the served GGUF loaded ``vocab_only`` (no weights), as in vLLM v1 the
front end tokenizes and detokenizes while the engine sees token ids only."""
from __future__ import annotations

import ctypes
import functools

import llama_cpp

from engine.llama.library import load_model


class Tokenizer:
    """Text <-> token ids with llama.cpp's tokenizer for the model at ``model_path``.

    Raises:
        ConfigError: the file is missing or not GGUF.
    """

    def __init__(self, model_path: str):
        self._model = load_model(model_path, vocab_only=True)
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        # Every token's bytes, precomputed once: detokenizing is then a list lookup.
        # Special tokens render as empty bytes (they are control, not text).
        buf = ctypes.create_string_buffer(256)
        self.pieces = []
        for t in range(self.n_vocab):
            n = llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, False)
            self.pieces.append(buf.raw[:n] if n > 0 else b"")
        # The text of the special tokens that render as nothing (control tokens), for decoding
        # with them shown (the /detokenize route, as a Hugging Face tokenizer decodes).
        self.special_pieces = {}
        for t in (t for t, p in enumerate(self.pieces) if not p):
            n = llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, True)
            if n > 0:
                self.special_pieces[t] = buf.raw[:n]
        self.bos = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos = llama_cpp.llama_vocab_eos(self.vocab)
        #: Bytes of the longest token: text of B bytes is at least B / this many tokens.
        self.max_piece_bytes = max(len(p) for p in self.pieces)
        tmpl = llama_cpp.llama_model_chat_template(self._model, None)
        self.chat_template = tmpl.decode("utf-8") if tmpl else None

    def encode(self, text: str, *, special: bool = False, add_bos: bool = False,
               add_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            special: parse special-token text (``<|im_start|>``) as those tokens. Off for user
                data, so such text stays plain text.
            add_bos: prepend BOS if the model wants one.
            add_special: add every token the vocabulary asks around a text (BOS, EOS:
                ``llama_tokenize``'s ``add_special``), as llama-server tokenizes an input to embed.
        """
        data = text.encode("utf-8")
        cap = len(data) + 8
        out = (llama_cpp.llama_token * cap)()
        wrap = add_special or (add_bos and self.add_bos)
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, cap, wrap, special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            out = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, cap, wrap, special)
        return list(out[:n])

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The texts ``encode(special=True)`` reads as one special token (control and
        user-defined tokens: ``<|im_start|>``), longest first. About 80 ms for a 49k vocabulary,
        on first use."""
        buf = ctypes.create_string_buffer(256)
        texts = set()
        for t in range(self.n_vocab):
            if llama_cpp.llama_vocab_get_attr(self.vocab, t) & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
                                                                 | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED):
                n = llama_cpp.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, True)
                if n > 0:
                    texts.add(buf.raw[:n].decode("utf-8", errors="replace"))
        return tuple(sorted(texts, key=len, reverse=True))

    def piece(self, token: int, special: bool = False) -> bytes:
        """UTF-8 bytes of one token (possibly part of a code point); ``special``: a control token
        as its text (``<|im_end|>``), otherwise as nothing."""
        return (special and self.special_pieces.get(token)) or self.pieces[token]

    def decode(self, tokens, special: bool = False) -> str:
        """Whole text of ``tokens``; invalid UTF-8 becomes U+FFFD. ``special``: control tokens
        are written as their text (``<|im_end|>``), otherwise as nothing."""
        pieces = self.pieces
        if special:
            return b"".join(self.special_pieces.get(t) or pieces[t] for t in tokens).decode("utf-8", errors="replace")
        return b"".join(pieces[t] for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int | None) -> str | None:
        """A special token's text (``bos``, ``eos``), None for None or -1 (the model has none)."""
        if token is None or token < 0:
            return None
        return (self.special_pieces.get(token) or self.pieces[token]).decode("utf-8", errors="replace")
