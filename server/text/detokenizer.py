"""Incremental, UTF-8-safe detokenization (:class:`Detokenizer`) and stop strings
(:class:`StopStrings`), which ``server/generation/choice.py`` applies, in that order with a tool
parser between them, to each choice's text.

Tokens arrive one at a time; a token may carry part of a code point (the bundled model splits
one CJK character over two tokens) and a stop string may span tokens or sit inside one. Text
goes out of the detokenizer only as whole code points, and out of the stop strings only when it
cannot become the start of a stop string; the rest is held back and flushed at the end when no
stop string matched. Invalid bytes inside the text become U+FFFD; an incomplete character at the
very end is dropped.
"""
from __future__ import annotations

import codecs


class StopStrings:
    """Ends a text at its first stop string, holding back a tail that may still become one.

    Args:
        stops: stop strings; the text ends right before the first of them to be complete (the
            occurrence that ends first; of those ending at the same place, the longest).
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add text; returns what is now safe to emit ('' if none). After a stop string
        matched, ``stopped`` is True and later calls return ''."""
        if self.stopped:
            return ""
        self._held += text
        if not self.stops:
            out, self._held = self._held, ""
            return out
        # The stop completed first ends the text (of those ending at the same place, the longest),
        # however the text was split into tokens: with "lo w" and " ", "Hello world" ends
        # "Hello" whether " world" arrives as one token or character by character. A stop's first
        # occurrence is the one that ends first.
        ends = [(i + len(s), i) for s, i in ((s, self._held.find(s)) for s in self.stops) if i >= 0]
        if ends:
            self.stopped = True
            out, self._held = self._held[:min(ends)[1]], ""
            return out
        keep = self._partial_stop_suffix()
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return out

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of the held text that is a proper prefix of a stop."""
        text = self._held
        for n in range(min(len(text), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """End of the text: what is held (nothing after a stop)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class Detokenizer:
    """Turns token byte-pieces into text deltas.

    Args:
        pieces: ``token id -> bytes`` (``Tokenizer.pieces``).
    """

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes ('' if none: part of a character)."""
        return self._utf8.decode(self.pieces[token])

    def flush(self) -> str:
        """End of generation: the text of the bytes still held. Bytes of a code point that
        generation cut short (``max_tokens`` inside a multi-byte character) are dropped, not
        sent as U+FFFD, as vLLM's detokenizer does; held bytes that no further byte could have
        completed (a surrogate's ``ED A1``, which Python's incremental decoder holds for a third
        byte) are invalid, U+FFFD each, as the whole text's decode writes them."""
        held = self._utf8.getstate()[0]
        self._utf8.reset()
        try:
            held.decode("utf-8")
            return ""
        except UnicodeDecodeError as e:
            cut_short = e.start == 0 and e.end == len(held) and e.reason == "unexpected end of data"
            return "" if cut_short else held.decode("utf-8", errors="replace")
