"""Writes an offline Qwen3 checkpoint: the real Qwen3 vocabulary, a chat template in Qwen3's format, RANDOM weights."""

import argparse
import logging
from pathlib import Path

from demo.vocab import write_json, write_tokenizer_files
from demo.weights import DTYPES, write_random_weights

logger = logging.getLogger(__name__)

# Shape of each preset; the rest of config.json is common to every Qwen3.
PRESETS = {
    # Exactly Qwen/Qwen3-0.6B.
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    # Small enough for CPU tests; keeps the full vocabulary so real prompts still tokenize.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}

DEMO_MARKER = "vllm_v0_demo_checkpoint"

README = """# Demo Qwen3 checkpoint ({preset}) with RANDOM weights

The weights in `model.safetensors` are RANDOM (seed {seed}, {dtype}): the model's output is gibberish.
They exist so the whole stack (tokenizer, model worker, gateway) runs offline with the real shapes.

The tokenizer is the real Qwen3 vocabulary (151,643 BPE tokens plus Qwen3's added tokens with
their usual ids), so prompts tokenize exactly as with Qwen/Qwen3-0.6B.

For real output, point the services at a real Qwen3 checkpoint directory instead
(e.g. a download of Qwen/Qwen3-0.6B with its config.json, tokenizer files and safetensors weights).

Made with: python -m demo.checkpoint --out DIR --preset {preset} --dtype {dtype} --seed {seed}
"""


def qwen3_config(preset: str, dtype: str, tie_word_embeddings: bool | None = None) -> dict:
    """config.json as Hugging Face writes it for Qwen3ForCausalLM."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": "qwen3",
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        # Padded past the tokenizer's 151,669 ids, as in the published model.
        "vocab_size": 151936,
        **PRESETS[preset],
    }
    config["max_window_layers"] = config["num_hidden_layers"]
    if tie_word_embeddings is not None:
        config["tie_word_embeddings"] = tie_word_embeddings
    return dict(sorted(config.items()))


def build_demo_checkpoint(
    out_dir: Path | str,
    preset: str = "tiny",
    dtype: str = "bfloat16",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    weights: bool = True,
) -> Path:
    """Write config, generation config, tokenizer files, RANDOM weights and a README into `out_dir`.

    Without `weights`, only the files the tokenizer service reads: its own copy of the checkpoint in
    a deployment where it does not share a volume with the worker.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    write_tokenizer_files(out_dir)
    config = qwen3_config(preset, dtype, tie_word_embeddings)
    # Read by the services so their logs say so too; transformers ignores unknown keys.
    config[DEMO_MARKER] = "RANDOM weights: the output is gibberish"
    write_json(out_dir / "config.json", config)
    if not weights:
        logger.info("Wrote the tokenizer files and config of a %s Qwen3 checkpoint to %s (no weights)", preset, out_dir)
        return out_dir
    write_random_weights(out_dir / "model.safetensors", config, dtype, seed)
    (out_dir / "README.md").write_text(README.format(preset=preset, dtype=dtype, seed=seed), encoding="utf-8")
    logger.warning(
        "Wrote a %s Qwen3 checkpoint to %s. Its weights are RANDOM, so its output is gibberish; "
        "for real output pass a real Qwen3 checkpoint.",
        preset,
        out_dir,
    )
    return out_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m demo.checkpoint",
        description="Write a Qwen3 checkpoint with the real vocabulary and RANDOM weights, for running offline.",
    )
    parser.add_argument("--out", required=True, type=Path, help="directory to write (created if missing)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape (default: tiny)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="weight dtype (default: bfloat16)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same bytes")
    parser.add_argument(
        "--untie-embeddings", action="store_true", help="write a separate lm_head.weight instead of tying it"
    )
    parser.add_argument(
        "--tokenizer-only", action="store_true",
        help="write only the tokenizer files and config.json, no weights: enough for the tokenizer service",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build_demo_checkpoint(
        args.out, args.preset, args.dtype, args.seed, tie_word_embeddings=False if args.untie_embeddings else None,
        weights=not args.tokenizer_only,
    )


if __name__ == "__main__":
    main()
