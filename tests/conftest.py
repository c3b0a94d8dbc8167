"""Shared fixtures (the demo checkpoint's tokenizer files, built once per session) and the `cuda` marker's skip."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter, on CPU tensors. It is chosen when triton is
    # first imported, so it must be set before any test module imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from demo.vocab import write_tokenizer_files
from services.tokenizer.core import TokenizerCore


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory):
    """tokenizer.json, tokenizer_config.json and generation_config.json of the demo checkpoint (no weights)."""
    return write_tokenizer_files(tmp_path_factory.mktemp("demo_tokenizer"))


@pytest.fixture(scope="session")
def demo_tokenizer(demo_tokenizer_dir):
    return TokenizerCore.from_dir(demo_tokenizer_dir)


@pytest.fixture(scope="session")
def hf_demo_tokenizer(demo_tokenizer_dir):
    """transformers' tokenizer on the same files, chat template included: the independent reference."""
    import json

    from transformers import PreTrainedTokenizerFast

    config = json.loads((demo_tokenizer_dir / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_file=str(demo_tokenizer_dir / "tokenizer.json"),
                                   chat_template=config["chat_template"], eos_token=config["eos_token"],
                                   pad_token=config["pad_token"])


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `cuda` where torch sees no CUDA device, so the same suite runs on CPU-only CI."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch  # only when a collected test asks for a GPU

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: torch sees no CUDA device")
    for item in marked:
        item.add_marker(skip)
