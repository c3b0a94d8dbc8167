"""Weights and KV cache on memory advised for huge pages: same contents, each tensor its own stretch."""
import pytest
import torch
from safetensors.torch import load_file

from services.model_worker.config.model import Qwen3Config
from services.model_worker.executor.kv_cache import KVCache
from services.model_worker.host import hugepages
from services.model_worker.model.loader import load_model
from tests.checkpoints import make_checkpoint


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds this address, from /proc/self/smaps."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


def test_tensors_are_zeroed_separate_and_advised():
    a, b, c = hugepages.tensors([((3, 5), torch.bfloat16), ((300, 1000), torch.float32), ((7,), torch.int64)])
    assert (a.shape, a.dtype, b.shape, b.dtype, c.shape, c.dtype) == (
        (3, 5), torch.bfloat16, (300, 1000), torch.float32, (7,), torch.int64)
    assert all(t.is_contiguous() and not t.any() for t in (a, b, c))
    assert a.data_ptr() % hugepages.HUGE_PAGE == 0  # the mapping's first tensor starts on a huge page
    assert b.data_ptr() % hugepages.ALIGN == 0 and c.data_ptr() % hugepages.ALIGN == 0
    b.fill_(1.5)
    assert not a.any() and not c.any() and b.sum().item() == 1.5 * 300 * 1000
    assert "hg" in mapping_flags(b.data_ptr())  # MADV_HUGEPAGE reached the kernel


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_loads_the_same_onto_huge_pages(tmp_path, tied):
    make_checkpoint(tmp_path, tie_word_embeddings=tied)
    config = Qwen3Config.from_json(tmp_path)
    on_huge = load_model(tmp_path, config, torch.device("cpu"), torch.float32, huge_pages=True)
    plain = load_model(tmp_path, config, torch.device("cpu"), torch.float32, huge_pages=False)
    stored = load_file(tmp_path / "model.safetensors")
    huge_params, plain_params = dict(on_huge.named_parameters()), dict(plain.named_parameters())
    assert huge_params.keys() == plain_params.keys()
    for name, param in huge_params.items():
        assert torch.equal(param, plain_params[name]), name
        assert "hg" in mapping_flags(param.data_ptr()) and "hg" not in mapping_flags(plain_params[name].data_ptr())
    assert torch.equal(on_huge.model.layers[0].mlp.down_proj.weight, stored["model.layers.0.mlp.down_proj.weight"])
    if tied:
        assert on_huge.lm_head.weight.data_ptr() == on_huge.model.embed_tokens.weight.data_ptr()


def test_kv_cache_on_huge_pages_is_zero_and_per_layer(tmp_path):
    make_checkpoint(tmp_path)
    config = Qwen3Config.from_json(tmp_path)
    cache = KVCache(config, num_blocks=9, block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    shape = (config.num_key_value_heads, 9 * 4, config.head_dim)
    assert len(cache.layers) == config.num_hidden_layers
    tensors = [t for pair in cache.layers for t in pair]
    assert all(t.shape == shape and t.dtype == torch.bfloat16 and not t.any() for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == len(tensors)
    tensors[1].fill_(1)  # layer 0's values: nothing else changes
    assert all(not t.any() for i, t in enumerate(tensors) if i != 1)
    assert "hg" in mapping_flags(tensors[0].data_ptr())
