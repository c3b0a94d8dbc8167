"""The tokenizer service reads a checkpoint's Sentence Transformers files and reports them in GetInfo."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from services.tokenizer.core import TokenizerCore, TokenizerLoadError
from services.tokenizer.embedding_config import EmbeddingConfig
from services.tokenizer.servicer import TokenizerServicer
from vllm_v0.tokenizer.v1 import tokenizer_pb2

# Qwen3-Embedding's files, as published.
QWEN3_EMBEDDING_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
QWEN3_EMBEDDING_POOLING = {"word_embedding_dimension": 1024, "pooling_mode_cls_token": False,
                           "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                           "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                           "pooling_mode_lasttoken": True, "include_prompt": True}
QWEN3_EMBEDDING_SETTINGS = {
    "prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\n"
                         "Query:", "document": ""},
    "default_prompt_name": None, "similarity_fn_name": "cosine"}


def write(folder, modules=QWEN3_EMBEDDING_MODULES, pooling=QWEN3_EMBEDDING_POOLING,
          settings=QWEN3_EMBEDDING_SETTINGS):
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(settings))
    return folder


def test_qwen3_embedding_files(tmp_path):
    config = EmbeddingConfig.from_dir(write(tmp_path))
    assert config.prompts == QWEN3_EMBEDDING_SETTINGS["prompts"] and config.default_prompt_name == ""
    assert config.modules == [m["type"] for m in QWEN3_EMBEDDING_MODULES]
    assert config.pooling_modes == ["lasttoken"]


def test_pooling_as_sentence_transformers_saves_it_now(tmp_path):
    from sentence_transformers.sentence_transformer.modules import Pooling

    (tmp_path / "modules.json").write_text(json.dumps(QWEN3_EMBEDDING_MODULES))
    (tmp_path / "1_Pooling").mkdir()
    for mode, want in (("lasttoken", ["lasttoken"]), (("cls", "mean"), ["cls", "mean"])):
        Pooling(64, pooling_mode=mode).save(str(tmp_path / "1_Pooling"))
        assert EmbeddingConfig.from_dir(tmp_path).pooling_modes == want


def test_no_files_is_an_empty_config(tmp_path):
    assert EmbeddingConfig.from_dir(tmp_path) == EmbeddingConfig()


def test_a_malformed_file_stops_the_tokenizer_with_its_name(tmp_path, demo_tokenizer_dir):
    folder = tmp_path / "ckpt"
    shutil.copytree(demo_tokenizer_dir, folder)
    write(folder, settings={"prompts": {"query": "q: "}, "default_prompt_name": "passage"})
    with pytest.raises(TokenizerLoadError, match="default_prompt_name 'passage' is not one of its prompts"):
        TokenizerCore.from_dir(folder)


def test_get_info_reports_the_prompts_and_pipeline(tmp_path, demo_tokenizer_dir):
    folder = tmp_path / "ckpt"
    shutil.copytree(demo_tokenizer_dir, folder)
    write(folder, settings={**QWEN3_EMBEDDING_SETTINGS, "default_prompt_name": "query"})
    servicer = TokenizerServicer(TokenizerCore.from_dir(folder))
    info = asyncio.run(servicer.GetInfo(tokenizer_pb2.GetInfoRequest(), None))
    assert dict(info.embedding_prompts) == QWEN3_EMBEDDING_SETTINGS["prompts"]
    assert info.default_embedding_prompt_name == "query"
    assert list(info.embedding_modules) == [m["type"] for m in QWEN3_EMBEDDING_MODULES]
    assert list(info.embedding_pooling_modes) == ["lasttoken"] and info.vocab_size > 0
