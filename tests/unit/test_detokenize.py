"""Streaming detokenization: the deltas of decode_incremental must add up to a full decode."""

import itertools
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TEXTS = {
    "emoji": "Party 🦜🤗 family 👩‍👩‍👧‍👦 flags 🇫🇷🏳️‍🌈!",
    "cjk": "中文分词测试：龘靐齉 and 日本語のテキスト",
    "combining accents": "e\u0301 a\u0300\u0316 Zalgo: Z\u0351\u036b\u0343a\u0310l\u0352g\u036bo",
    "astral letters": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓂀 done",
    "ascii": "def f(x):\n    return x * 2  # plain\n",
}
CHAT = "<|im_start|>assistant\n<think>\n想一想 🤔\n</think>\n\n答案是 42<|im_end|><|endoftext|>"

# Fed one id at a time, the window holds the last emitted piece (a character cut into up to
# four byte tokens) plus the pieces of the next cut character: it must not grow with the stream.
MAX_WINDOW_ONE_BY_ONE = 8


def stream(core, ids, chunk_sizes, skip_special_tokens):
    """Feed `ids` the way a client would; return the deltas, the last one from the final call."""
    window, read_offset, deltas = [], 0, []
    max_window = MAX_WINDOW_ONE_BY_ONE if chunk_sizes == (1,) else len(ids)
    sizes = itertools.cycle(chunk_sizes)
    position = 0
    while position < len(ids):
        size = next(sizes)
        window += ids[position : position + size]
        position += size
        text, prefix_advance, read_offset = core.decode_incremental(window, read_offset, skip_special_tokens)
        deltas.append(text)
        window = window[prefix_advance:]
        assert len(window) <= max_window
    text, _, _ = core.decode_incremental(window, read_offset, skip_special_tokens, final=True)
    deltas.append(text)
    return deltas


def byte_token(core, byte: int) -> int:
    """The id of a single-byte token, via the byte-level alphabet (0xA1..0xFF map to themselves)."""
    return core.tokenizer.token_to_id(chr(byte))


@pytest.mark.parametrize("chunk_sizes", [(1,), (2,), (3,), (1, 3, 2)])
@pytest.mark.parametrize("name", TEXTS)
def test_stream_equals_full_decode(demo_tokenizer, name, chunk_sizes):
    ids = demo_tokenizer.encode(TEXTS[name])
    deltas = stream(demo_tokenizer, ids, chunk_sizes, skip_special_tokens=False)
    # Encoding applies NFC, so that is the text a decode gives back.
    assert "".join(deltas) == demo_tokenizer.decode(ids) == unicodedata.normalize("NFC", TEXTS[name])
    assert not any("\ufffd" in delta for delta in deltas)


def test_texts_really_split_characters_across_tokens(demo_tokenizer):
    # Guards the tests above: each non-ASCII text must contain a token that is not whole UTF-8 on its own.
    for name, text in TEXTS.items():
        if name != "ascii":
            ids = demo_tokenizer.encode(text)
            assert any("\ufffd" in demo_tokenizer.decode([token_id]) for token_id in ids), name


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("chunk_sizes", [(1,), (2, 3)])
def test_special_tokens_stream(demo_tokenizer, skip_special_tokens, chunk_sizes):
    ids = demo_tokenizer.encode(CHAT)
    deltas = stream(demo_tokenizer, ids, chunk_sizes, skip_special_tokens)
    joined = "".join(deltas)
    assert joined == demo_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "\ufffd" not in joined
    # <think> is not special in Qwen3, so it survives skip_special_tokens; <|im_end|> does not.
    assert "<think>" in joined
    assert ("<|im_end|>" in joined) is not skip_special_tokens


def test_special_token_inside_a_cut_character(demo_tokenizer):
    head, tail = demo_tokenizer.encode("龘")
    ids = [head, 151645, tail]
    skipped = stream(demo_tokenizer, ids, (1,), skip_special_tokens=True)
    assert "".join(skipped) == "龘" and not any("\ufffd" in delta for delta in skipped)
    kept = stream(demo_tokenizer, ids, (1,), skip_special_tokens=False)
    assert "".join(kept) == demo_tokenizer.decode(ids) == "\ufffd<|im_end|>\ufffd"


def test_invalid_utf8_at_the_end_is_emitted_only_on_the_final_call(demo_tokenizer):
    ids = demo_tokenizer.encode("ok") + [byte_token(demo_tokenizer, 0xE4)]
    deltas = stream(demo_tokenizer, ids, (1,), skip_special_tokens=False)
    assert "".join(deltas) == demo_tokenizer.decode(ids) == "ok\ufffd"
    assert deltas[-1] == "\ufffd" and not any("\ufffd" in delta for delta in deltas[:-1])


def test_invalid_utf8_in_the_middle_matches_full_decode(demo_tokenizer):
    ids = [byte_token(demo_tokenizer, 0xE4), byte_token(demo_tokenizer, 0xB8)] + demo_tokenizer.encode(" ok")
    deltas = stream(demo_tokenizer, ids, (1,), skip_special_tokens=False)
    assert "".join(deltas) == demo_tokenizer.decode(ids) == "\ufffd ok"


def test_edge_calls(demo_tokenizer):
    assert demo_tokenizer.decode_incremental([], 0) == ("", 0, 0)
    assert demo_tokenizer.decode_incremental([], 0, final=True) == ("", 0, 0)
    # Ids that decode to nothing still move the window on.
    assert demo_tokenizer.decode_incremental([151643, 151643], 0, skip_special_tokens=True) == ("", 0, 2)
    ids = demo_tokenizer.encode("Hello world")
    assert demo_tokenizer.decode_incremental(ids, 1) == (" world", 1, 1)
    # A cut character is held back: nothing emitted, nothing dropped, same read_offset.
    head, _ = demo_tokenizer.encode("龘")
    assert demo_tokenizer.decode_incremental(ids + [head], 2) == ("", 0, 2)
    # A first read_offset that cuts a character: the whole character is new text.
    assert demo_tokenizer.decode_incremental(demo_tokenizer.encode("龘"), 1) == ("龘", 1, 1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60), chunk=st.integers(1, 3))
def test_any_text_streams_like_full_decode(demo_tokenizer, text, chunk):
    ids = demo_tokenizer.encode(text)
    deltas = stream(demo_tokenizer, ids, (chunk,), skip_special_tokens=False)
    assert "".join(deltas) == demo_tokenizer.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in delta for delta in deltas)


# Single bytes (to cut characters anywhere, valid or not), ordinary tokens and added tokens.
ANY_ID = st.one_of(st.integers(0, 255), st.integers(0, 151642), st.integers(151643, 151668))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(ANY_ID, max_size=30), chunk=st.integers(1, 3), skip=st.booleans())
def test_any_ids_stream_like_full_decode(demo_tokenizer, ids, chunk, skip):
    deltas = stream_unbounded(demo_tokenizer, ids, chunk, skip)
    assert "".join(deltas) == demo_tokenizer.decode(ids, skip_special_tokens=skip)


def stream_unbounded(core, ids, chunk, skip):
    # Random bytes can hold a character back for long runs, so no window bound here.
    window, read_offset, deltas = [], 0, []
    for position in range(0, len(ids), chunk):
        window += ids[position : position + chunk]
        text, prefix_advance, read_offset = core.decode_incremental(window, read_offset, skip)
        deltas.append(text)
        window = window[prefix_advance:]
    deltas.append(core.decode_incremental(window, read_offset, skip, final=True)[0])
    return deltas
