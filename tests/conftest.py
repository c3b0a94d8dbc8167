"""Shared fixtures: the demo checkpoint's tokenizer files, built once per test session."""

import pytest

from demo.vocab import write_tokenizer_files
from services.tokenizer.core import TokenizerCore


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory):
    """tokenizer.json, tokenizer_config.json and generation_config.json of the demo checkpoint (no weights)."""
    return write_tokenizer_files(tmp_path_factory.mktemp("demo_tokenizer"))


@pytest.fixture(scope="session")
def demo_tokenizer(demo_tokenizer_dir):
    return TokenizerCore.from_dir(demo_tokenizer_dir)
