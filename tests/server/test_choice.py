"""One choice's output (``server/generation/choice.py``): the echo first, then each token through
the detokenizer, the tool-call parser and the stop strings, in that order, then the finish
reason. Real detokenizer, stop strings and tool parser; the pieces are a made-up vocabulary."""
from __future__ import annotations

import json

from engine.stream import Token
from server.generation.choice import ChoiceState
from server.tools import formats
from server.tools.parser import ToolCallParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris END"}}\n</tool_call>'


def vocabulary(*texts: str | bytes) -> tuple[list[bytes], list[Token]]:
    """Pieces spelling ``texts`` one token each, and those tokens (token ``k`` spells ``texts[k]``)."""
    pieces = [t if isinstance(t, bytes) else t.encode() for t in texts]
    return pieces, [Token(k) for k in range(len(pieces))]


def read(choice: ChoiceState, tokens: list[Token], reason: str = "length") -> tuple[str, list, str, list]:
    """Push each token alone (as a stream that keeps up), then finish unless the choice ended:
    ``(text, [(name, arguments)], finish_reason, deltas)``."""
    deltas = [d for t in tokens for d in choice.push([t])]
    if not choice.ended:
        deltas.append(choice.finish(reason))
    calls = []
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                calls.append([c.name, ""])
            calls[c.index][1] += c.arguments
    return "".join(d.text for d in deltas), [tuple(c) for c in calls], deltas[-1].finish_reason, deltas


def test_a_stop_string_across_tokens_and_inside_a_character_split():
    """The detokenizer comes first: a stop string is matched in whole characters, across
    tokens; a character split over two tokens is never half-sent."""
    pieces, tokens = vocabulary("Hel", "lo ", b"\xe4\xbd", b"\xa0", "!")
    text, _, reason, deltas = read(ChoiceState(0, pieces, ["o 你"]), tokens)
    assert (text, reason) == ("Hell", "stop")
    # "o " is held (it may start the stop), and "你"'s first byte shows nothing: no delta
    assert [(d.text, len(d.tokens)) for d in deltas] == [("Hel", 1), ("l", 1), ("", 0)]
    text, _, reason, _ = read(ChoiceState(0, pieces, []), tokens)
    assert (text, reason) == ("Hello 你!", "length")


def test_the_tool_parser_comes_before_the_stop_strings():
    """A stop string inside a call's arguments does not cut them; one in the visible text after
    the parser ends the choice, and a choice that made calls and stopped says ``tool_calls``."""
    pieces, tokens = vocabulary("I will check. ", CALL[:30], CALL[30:], " END of it")
    choice = ChoiceState(0, pieces, ["END"], ToolCallParser(formats.HERMES))
    text, calls, reason, _ = read(choice, tokens)
    assert text == "I will check."
    assert [name for name, _ in calls] == ["get_weather"]
    assert json.loads(calls[0][1]) == {"city": "Paris END"}
    assert reason == "tool_calls" and choice.ended and choice.tool_calls == 1
    assert choice.completion_tokens == 4


def test_a_stop_string_in_the_visible_text_with_a_tool_parser():
    pieces, tokens = vocabulary("The answer", " is 4", "2. STOP", " and more")
    choice = ChoiceState(0, pieces, ["STOP"], ToolCallParser(formats.HERMES))
    deltas = [d for t in tokens[:3] for d in choice.push([t])]
    assert choice.ended and deltas[-1].finish_reason == "stop"  # within the third token: the stream is cancelled
    assert "".join(d.text for d in deltas) == "The answer is 42. "
    assert choice.push(tokens[3:]) == [] and choice.completion_tokens == 3  # a cancelled sequence's last tokens


def test_a_stop_string_ends_the_choice_mid_batch():
    """Tokens that arrive together are read up to the stop string; its logprob entries end
    there too."""
    pieces, _ = vocabulary("a", "b", "c", "d")
    tokens = [Token(k, -0.5) for k in range(4)]
    choice = ChoiceState(0, pieces, ["bc"])
    deltas = choice.push(tokens)
    assert [d.text for d in deltas] == ["a", "", "", ""] and deltas[-1].finish_reason == "stop"
    assert [t.id for d in deltas for t in d.tokens] == [0, 1, 2] and choice.completion_tokens == 3


def test_the_finish_reason_comes_last():
    """The stream's reason unless a stop string completed in the held text at the end, or calls
    were made and it stopped."""
    pieces, tokens = vocabulary("Hi", b"\xed\xa1")  # held bytes no byte completes: U+FFFD each at the end
    assert read(ChoiceState(0, pieces, ["\ufffd"]), tokens)[:3:2] == ("Hi", "stop")
    assert read(ChoiceState(0, pieces, []), tokens)[:3:2] == ("Hi\ufffd\ufffd", "length")
    pieces, tokens = vocabulary(CALL)
    assert read(ChoiceState(0, pieces, [], ToolCallParser(formats.HERMES)), tokens, "stop")[2] == "tool_calls"
    assert read(ChoiceState(0, pieces, [], ToolCallParser(formats.HERMES)), tokens, "length")[2] == "length"


def test_one_call_when_the_parser_is_done():
    pieces, tokens = vocabulary(CALL, "\n" + CALL)
    choice = ChoiceState(0, pieces, [], ToolCallParser(formats.HERMES, max_calls=1))
    _, calls, reason, _ = read(choice, tokens)
    assert len(calls) == 1 and reason == "tool_calls" and choice.completion_tokens == 1


def test_the_echo_comes_first():
    pieces, tokens = vocabulary("Say", " hi", " there")
    scored = []

    def prompt_entries():  # read when the echo goes out: after the prompt was scored
        scored.append(True)
        return [Token(0), Token(1, -1.5)]

    choice = ChoiceState(0, pieces, [], echo="Say hi", prompt_entries=prompt_entries)
    assert scored == []
    first = choice.push([])  # a scoring request's first poll may hold no token yet
    assert [(d.echo, d.text, [t.id for t in d.tokens]) for d in first] == [(True, "Say hi", [0, 1])]
    text, _, reason, deltas = read(choice, tokens[2:])
    assert (text, reason, scored) == (" there", "length", [True]) and not any(d.echo for d in deltas)
    # a choice that generates nothing: its only delta starts with the echo
    nothing = ChoiceState(3, pieces, [], echo="Say hi")
    last = nothing.finish("length")
    assert (last.index, last.text, last.finish_reason, nothing.completion_tokens) == (3, "Say hi", "length", 0)


def test_token_arrival_times():
    pieces, tokens = vocabulary("a", "b", "c", "d")
    choice = ChoiceState(0, pieces, [])
    choice.push([])
    assert choice.first_token_at is None and choice.token_gaps == []
    choice.push(tokens[:1])
    choice.push(tokens[1:])  # three together share the gap since the first
    assert choice.first_token_at is not None and len(choice.token_gaps) == 3
    assert all(g >= 0 for g in choice.token_gaps) and len(set(choice.token_gaps)) == 1
