"""8-bit weights under tensor parallelism (two gloo ranks): each rank holds its rows' scales, and the ranks
together compute what one rank does."""
import json
import os
import subprocess
import sys

import pytest
import torch

from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.model.layers.linear import RowParallelLinear
from services.model_worker.model.layers.quant.eight_bit import EightBitLinearMethod
from tests.checkpoints import make_checkpoint
from tests.quant_checkpoints import write_fp8
from tests.tp_probe import probe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Row-parallel inputs split into whole 128-blocks (q heads 4 x 64 = 256, intermediate 512); the hidden size
# (192) ends in a partial block; a rank's 64 k/v rows are half a block, its 128 q rows one.
SHAPE = dict(hidden_size=192, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             tie_word_embeddings=False)


def run_probe(checkpoint, size: int, out_path, quantization: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-m", "tests.tp_probe", str(checkpoint), str(size), str(out_path), quantization],
                   cwd=ROOT, env=env, check=True, timeout=180)
    with open(out_path) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=["fp8-checkpoint", "int8"])
def runs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    make_checkpoint(root / "src", **SHAPE)
    if request.param == "int8":
        path, quantization = root / "src", "int8"
    else:
        write_fp8(root / "src", root / "fp8", root / "fp8_dequantized")
        path, quantization = root / "fp8", "none"
    return probe(str(path), 1, quantization), run_probe(path, 2, root / "tp2.json", quantization)


def test_two_ranks_compute_what_one_does(runs):
    one, two = runs
    assert (torch.tensor(two["logits"]) - torch.tensor(one["logits"])).abs().max().item() <= 1e-4
    for key in ("greedy", "batched", "chunked", "prefix_hit"):
        assert two[key] == one[key], key


def test_row_parallel_blocks_that_would_straddle_ranks_are_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        RowParallelLinear(320, 64, method=EightBitLinearMethod("fp8", True), tp=TensorParallel(rank=0, size=2))
