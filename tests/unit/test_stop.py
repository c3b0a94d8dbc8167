"""Tests for the streaming stop-string matcher against a whole-text reference."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text.stop import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The rule the matcher must follow, on the whole text at once.

    Scan end positions e = 1..len(text); at the first e where text[:e] ends with some
    stop, cut before the longest stop ending there (the earliest start). No stop
    anywhere: the whole text.
    """
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def run(deltas: list[str], stops: list[str]) -> tuple[str, str | None, list[str]]:
    """Feeds every delta, then flushes; returns (all text emitted, stop, pieces)."""
    matcher = StopStringMatcher(stops)
    pieces, stop = [], None
    for delta in deltas:
        piece, stop = matcher.feed(delta)
        pieces.append(piece)
    if stop is None:
        pieces.append(matcher.flush())
    return "".join(pieces), stop, pieces


def test_no_stops_emits_everything_at_once():
    matcher = StopStringMatcher([])
    assert matcher.feed("hello") == ("hello", None)
    assert matcher.feed(" world") == (" world", None)
    assert matcher.flush() == ""


def test_stop_inside_one_delta_cuts_before_it():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abcSTOPdef") == ("abc", "STOP")
    assert matcher.stop == "STOP"


def test_feeds_after_a_match_return_nothing():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", "x")
    assert matcher.feed("more") == ("", "x")
    assert matcher.flush() == ""


def test_possible_start_is_held_back_until_decided():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("text </e") == ("text ", None)
    # "</ex" can no longer become "</end>": the held text is released.
    assert matcher.feed("x") == ("</ex", None)
    assert matcher.flush() == ""


def test_held_text_is_released_by_flush():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xxab") == ("xx", None)
    assert matcher.flush() == "ab"


def test_stop_spanning_many_deltas():
    stop = "<|stop here|>"
    deltas = ["before ", "<", "|st", "o", "p", " ", "he", "r", "e|", ">after"]
    emitted, matched, pieces = run(deltas, [stop])
    assert (emitted, matched) == ("before ", stop)
    assert pieces[0] == "before "
    assert all(piece == "" for piece in pieces[1:])


def test_stop_at_the_very_start():
    assert run(["STOP", "rest"], ["STOP"])[:2] == ("", "STOP")
    assert run(["S", "T", "OP"], ["STOP"])[:2] == ("", "STOP")


def test_overlapping_stops_earliest_end_wins():
    # "ab" completes before "abc" could, so it is the match.
    assert run(["xab", "c"], ["abc", "ab"])[:2] == ("x", "ab")
    assert run(["xa", "bc"], ["abc", "ab"])[:2] == ("x", "ab")
    # "b" ends at the same moment "ab" would start being decided; "b" ends first.
    assert run(["abc"], ["abc", "b"])[:2] == ("a", "b")


def test_same_end_prefers_the_longest_stop():
    assert run(["xabc"], ["bc", "abc"])[:2] == ("x", "abc")
    assert run(["xa", "b", "c"], ["c", "abc", "bc"])[:2] == ("x", "abc")


def test_self_overlapping_stop():
    # "aab" inside "aaab": the first "a" must be released, not swallowed.
    assert run(["a", "a", "a", "b"], ["aab"])[:2] == ("a", "aab")
    assert run(["aaa", "c"], ["aab"])[:2] == ("aaac", None)


def test_multi_codepoint_unicode():
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # one emoji, five code points
    stop = "é" + family
    deltas = ["café", "\U0001f468", "\u200d\U0001f469", "\u200d", "\U0001f467", " après"]
    assert run(deltas, [stop])[:2] == ("caf", stop)
    assert run(["日本", "語の", "文"], ["語の文"])[:2] == ("日本", "語の文")


def test_held_back_text_never_exceeds_longest_stop_minus_one():
    matcher = StopStringMatcher(["aaaaab", "xy"])
    for _ in range(100):
        matcher.feed("a")
        assert len(matcher._held) <= 5


def test_empty_delta_is_harmless():
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("") == ("", None)
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("") == ("", None)
    assert matcher.feed("b") == ("", "ab")


def test_duplicate_stops_are_fine():
    assert run(["xaby"], ["ab", "ab"])[:2] == ("x", "ab")


def test_empty_stop_is_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_long_stream_only_looks_at_a_window():
    # Stop strings absent from a long stream: everything comes out, in order, promptly.
    matcher = StopStringMatcher(["NEVER"])
    pieces = [matcher.feed("word ")[0] for _ in range(10_000)]
    assert "".join(pieces) + matcher.flush() == "word " * 10_000
    assert all(piece == "word " for piece in pieces)


ALPHABET = "abé\U0001f600"


@st.composite
def text_deltas_and_stops(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    # Random cut points split the text into deltas, empty ones included.
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    stops = draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=4))
    return text, deltas, stops


@settings(max_examples=600, deadline=None)
@given(text_deltas_and_stops())
def test_streaming_matches_the_whole_text_reference(case):
    text, deltas, stops = case
    emitted, stop, _ = run(deltas, stops)
    assert (emitted, stop) == reference(text, stops)


@settings(max_examples=300, deadline=None)
@given(text_deltas_and_stops())
def test_emitted_text_is_never_taken_back(case):
    # Whatever was emitted after each feed is a prefix of the final answer.
    text, deltas, stops = case
    expected, _ = reference(text, stops)
    matcher = StopStringMatcher(stops)
    so_far = ""
    for delta in deltas:
        piece, _ = matcher.feed(delta)
        so_far += piece
        assert expected.startswith(so_far)
