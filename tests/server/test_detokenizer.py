"""The incremental detokenizer (server/text/detokenizer.py) on made-up token pieces: a character
split over tokens is never emitted in halves, stop strings inside one token and across tokens,
a held-back prefix of a stop string flushed at the end, a character cut short dropped."""
from __future__ import annotations

from engine.stream import Token
from server.generation.choice import ChoiceState

PIECES = [b"Hel", b"lo", b",", b" wor", b"ld", b"\xe4\xbd", b"\xa0", b"\xe5\xa5\xbd", b"!"]


def run(tokens: list[int], stops: list[str]) -> tuple[list[str], str, bool]:
    """Each token's text, the text at the end, and whether a stop string ended the choice, as a
    choice without tools reads them (detokenizer, then stop strings)."""
    choice = ChoiceState(0, PIECES, stops)
    deltas = ["".join(d.text for d in choice.push([Token(t)])) for t in tokens]
    tail = "" if choice.ended else choice.finish("length").text
    return deltas, tail, choice.finish_reason == "stop"


def test_split_code_point_is_never_emitted_in_halves():
    deltas, tail, _ = run([5, 6, 7], [])
    assert deltas == ["", "你", "好"] and tail == ""


def test_stop_inside_one_token_and_across_tokens():
    assert run([0, 1, 2, 3], ["ll"]) == (["He", "", "", ""], "", True)
    deltas, tail, stopped = run([0, 1, 2, 3, 4], ["o, wo"])
    assert "".join(deltas) == "Hell" and stopped and tail == ""
    assert all("o, wo"[:2] not in d for d in deltas)


def test_held_back_prefix_of_a_stop_is_flushed_at_the_end():
    deltas, tail, stopped = run([0, 1], ["lo!"])
    assert deltas == ["He", "l"] and tail == "lo" and not stopped  # "l", then "lo", could start "lo!"


def test_character_cut_short_at_the_end_is_dropped():
    deltas, tail, _ = run([0, 5], [])
    assert deltas == ["Hel", ""] and tail == ""
