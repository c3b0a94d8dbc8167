"""The Python byte-level decode of stream windows against tokenizers' own decode (Rust), the reference."""
import json
import random
import shutil

import pytest

from services.tokenizer.byte_level import ByteLevelText
from services.tokenizer.core import TokenizerCore


def reference(core: TokenizerCore, ids: list[int], skip: bool) -> str:
    return core.tokenizer.decode_batch([ids], skip_special_tokens=skip)[0]


@pytest.fixture(scope="module")
def padded(demo_tokenizer_dir, tmp_path_factory) -> TokenizerCore:
    """The demo tokenizer under a model whose embedding has padding rows past the vocabulary, as Qwen3's."""
    out = tmp_path_factory.mktemp("padded")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo_tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    return TokenizerCore.from_dir(out)


@pytest.mark.parametrize("skip", [False, True])
def test_random_windows_decode_as_tokenizers_does(padded, skip):
    """Single-byte tokens in any order make every kind of invalid or cut UTF-8; special, non-special added
    and padding ids are mixed in."""
    text = padded.byte_level
    assert text is not None
    rng = random.Random(7)
    pools = [range(0, 300), range(300, 151643), range(151643, 151669), range(151669, 151936)]
    for _ in range(3000):
        ids = [rng.choice(rng.choices(pools, weights=[6, 3, 1, 1])[0]) for _ in range(rng.randint(0, 12))]
        assert text.decode(ids, skip) == reference(padded, ids, skip), ids


def test_every_single_byte_and_each_added_token_alone(padded):
    text = padded.byte_level
    for token_id in [*range(0, 512), *range(151643, 151669), 151700]:
        for skip in (False, True):
            assert text.decode([token_id], skip) == reference(padded, [token_id], skip), token_id


def test_a_decoder_other_than_byte_level_keeps_tokenizers_decode(demo_tokenizer_dir, tmp_path):
    config = json.loads((demo_tokenizer_dir / "tokenizer.json").read_text())
    config["decoder"] = {"type": "Sequence", "decoders": [config["decoder"]]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    core = TokenizerCore.from_dir(tmp_path)
    assert ByteLevelText.of(core.tokenizer) is None and core.byte_level is None
    assert core.decode_incremental(core.encode("Hello world"), 1) == (" world", 1, 1)
