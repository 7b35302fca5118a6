"""Stop-string matching and message normalisation (pure Python, trio side)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_mlx import InvalidRequestError
from trio_mlx.engine._text import StopMatcher, normalize_messages


def feed_all(matcher: StopMatcher, chunks: list[str]) -> tuple[str, str | None]:
    out = []
    for chunk in chunks:
        text, stop = matcher.feed(chunk)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    out.append(matcher.flush())
    return "".join(out), None


def test_stop_split_across_chunks_is_found_and_never_emitted():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", None)  # "</" is held back
    assert m.feed("en") == ("", None)
    assert m.feed("d> tail") == ("", "</end>")


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("ART") == ("START", None)
    assert m.flush() == ""


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", "lo w")


def test_empty_stop_list_is_falsy_and_passes_text_through():
    m = StopMatcher(["", ""])
    assert not m
    assert m.feed("abc") == ("abc", None)


@given(
    text=st.text(alphabet="abc<>/", max_size=40),
    stop=st.text(alphabet="abc<>/", min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_chunking_never_changes_the_result(text, stop, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    got = feed_all(StopMatcher([stop]), chunks)
    if stop in text:
        assert got == (text[: text.index(stop)], stop)
    else:
        assert got == (text, None)


def test_normalize_messages_joins_text_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert normalize_messages(msgs) == [{"role": "user", "content": "ab"}]
    assert normalize_messages([{"role": "assistant", "content": None}])[0]["content"] == ""


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
)
def test_normalize_messages_rejects_bad_shapes(bad):
    with pytest.raises(InvalidRequestError):
        normalize_messages(bad)
