"""A step reads device values back once: the sampled ids (with logprobs when asked).

On a GPU every read of a device tensor from the host (tolist, item, int(), bool(), nonzero,
cpu) waits for the GPU to finish, and so does a Python number assigned through tensor indices
(`t[rows, cols] = True`: index_put_ copies the number to the GPU first). This counts both during
engine steps on CPU, leaving out the host-side building of step inputs, which reads only host
tensors (the GPU test checks the real thing with CUDA's sync debug mode).
"""
import traceback
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"}
# StepInputs.build, and the layout CPU backends take for mixed steps, work on host tensors.
HOST_SIDE = {"build", "from_inputs"}


def tensor_indexed(index) -> bool:
    """Whether an index is advanced (a tensor in it), so that assigning through it is an index_put_."""
    return isinstance(index, torch.Tensor) or (isinstance(index, tuple) and
                                               any(isinstance(i, torch.Tensor) for i in index))


class DeviceReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__setitem__" and isinstance(args[2], (bool, int, float)) and tensor_indexed(args[1]):
            frame = traceback.extract_stack()[-2]
            self.reads.append(("scalar index_put_", frame.filename.rsplit("/", 1)[-1], frame.lineno))
        if name in READS:
            frames = traceback.extract_stack()[:-1]
            if not any(f.name in HOST_SIDE and f.filename.endswith(("step_inputs.py", "metadata.py"))
                       for f in frames):
                self.reads.append((name, frames[-1].filename.rsplit("/", 1)[-1], frames[-1].lineno))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("syncs")
    make_checkpoint(path)
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=64, block_size=8))


PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "top_p_seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=5),
    "min_p_unseeded": SamplingParams(temperature=1.2, min_p=0.1),
    "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.2),
    "logprobs": SamplingParams(temperature=0.7, logprobs=5),
}


@pytest.mark.parametrize("kinds", [["greedy"], list(PARAMS)], ids=["greedy", "every_kind"])
def test_each_step_reads_the_device_once(engine, kinds):
    for i, kind in enumerate(kinds):
        params = SamplingParams(**{**PARAMS[kind].__dict__, "max_tokens": 6, "ignore_eos": True})
        engine.add_request(f"{len(kinds)}-{kind}-{i}", [3 + i, 1, 4, 1, 5][:2 + i % 4], params)
    steps = 0
    while engine.has_work():
        counter = DeviceReads()
        with counter:
            outputs = engine.step()
        if outputs:  # prefill, mixed and decode steps alike
            steps += 1
            assert len(counter.reads) == 1, counter.reads
    assert steps >= 6


def test_the_counter_sees_a_device_read():
    counter = DeviceReads()
    with counter:
        torch.ones(3).sum().item()
    assert [r[0] for r in counter.reads] == ["item"]


def test_the_counter_sees_a_python_number_assigned_through_tensor_indices():
    counter = DeviceReads()
    t, rows = torch.zeros(2, 3), torch.tensor([0, 1])
    with counter:
        t[0] = 1.0  # a plain index: fill_, which takes the number as an argument
        t[rows, rows] = torch.ones(2)  # a device tensor: no copy
        t[rows, rows] = 2.0
    assert [r[0] for r in counter.reads] == ["scalar index_put_"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_the_gpu_a_decode_step_synchronises_once(tmp_path):
    make_checkpoint(tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(device="cuda", dtype="bfloat16", num_blocks=64, block_size=16,
                                              max_model_len=256))
    for i, kind in enumerate(PARAMS):
        params = SamplingParams(**{**PARAMS[kind].__dict__, "max_tokens": 8, "ignore_eos": True})
        engine.add_request(f"gpu-{kind}-{i}", [3 + i, 1, 4], params)
    engine.step()  # the prefill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
