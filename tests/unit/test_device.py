"""--device is resolved and checked against the GPUs torch can see, before any weights load (GPUs faked on CPU)."""
import pytest
import torch

from services.model_worker.model.loader import LoadError, resolve_device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees `n` CUDA devices (0: none)."""
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def test_auto_is_cuda_when_a_gpu_is_visible(gpus):
    gpus(1)
    assert resolve_device("auto") == torch.device("cuda", 0)
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")


def test_each_visible_index_is_accepted(gpus):
    gpus(2)
    assert resolve_device("cuda") == torch.device("cuda", 0)  # always an index: set_device needs one
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


@pytest.mark.parametrize("name, count", [("cuda:2", 2), ("cuda:1", 1), ("cuda:7", 4)])
def test_an_index_past_the_device_count_is_refused(gpus, name, count):
    gpus(count)
    with pytest.raises(LoadError) as error:
        resolve_device(name)
    message = str(error.value)
    assert f"--device {name}" in message
    assert f"torch sees {count}" in message
    assert f"cuda:{count - 1}" in message


def test_cuda_without_a_visible_gpu_says_why(gpus):
    gpus(0)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(LoadError, match=f"--device {name} was asked for, but no CUDA GPU is visible"):
            resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "mps"])
def test_unknown_devices_are_refused_with_the_choices(gpus, name):
    gpus(1)
    with pytest.raises(LoadError, match=f"--device {name}"):
        resolve_device(name)


def test_cpu_needs_no_gpu(gpus):
    gpus(0)
    assert resolve_device("cpu") == torch.device("cpu")


class FakeCuda:
    """torch.cuda's current device, device contexts, syncs and graph capture on a pretend two-GPU machine.

    Records which device each call acted on, so a test can see that nothing fell back to cuda:0.
    """

    def __init__(self, monkeypatch):
        self.current = 0
        self.calls: list[tuple[str, int]] = []
        fake = self

        class Device:
            def __init__(self, device):
                self.index = torch.device(device).index

            def __enter__(self):
                self.previous, fake.current = fake.current, self.index

            def __exit__(self, *exc):
                fake.current = self.previous

        class Graph:
            def __init__(self, graph, pool=None):
                pass

            def __enter__(self):
                fake.calls.append(("capture", fake.current))

            def __exit__(self, *exc):
                pass

        def set_device(device):
            if torch.device(device).index is None:  # as torch 2.11 does
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            fake.current = torch.device(device).index
            fake.calls.append(("set_device", fake.current))

        def synchronize(device=None):
            fake.calls.append(("synchronize", fake.current if device is None else torch.device(device).index))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "device", Device)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(torch.cuda, "graph", Graph)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


@pytest.mark.parametrize("device, index", [("cuda:1", 1), ("cuda", 0), ("auto", 0)])
def test_the_executor_sets_the_workers_gpu_before_anything_runs(monkeypatch, tmp_path, device, index):
    from services.model_worker.config.engine import EngineConfig
    from services.model_worker.executor import executor
    from tests.checkpoints import make_checkpoint

    cuda = FakeCuda(monkeypatch)
    make_checkpoint(tmp_path)

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        cuda.calls.append(("load", cuda.current))
        raise Loaded

    monkeypatch.setattr(executor, "load_model", load_model)
    config = EngineConfig(device=device)
    with pytest.raises(Loaded):
        executor.Executor(tmp_path, config, executor.Qwen3Config.from_json(tmp_path))
    assert cuda.calls == [("set_device", index), ("load", index)]


def test_graph_capture_and_its_syncs_name_the_workers_gpu(monkeypatch):
    from services.model_worker.executor.cuda_graphs import DecodeGraphs
    from services.model_worker.executor.step_inputs import StepInputs

    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(StepInputs, "to", lambda self, device: self)  # the buffers stay on the host

    def model(*args):
        cuda.calls.append(("forward", cuda.current))
        return torch.zeros(1)

    graphs = DecodeGraphs(model, [], None, torch.device("cuda", 1), max_num_seqs=2, table_width=2, block_size=4,
                          pad_block=0)
    graphs.capture()
    assert {device for _, device in cuda.calls} == {1}, cuda.calls
    assert [kind for kind, _ in cuda.calls].count("capture") == 2
    assert ("synchronize", 1) in cuda.calls


def test_the_triton_kernel_launches_on_the_device_of_its_inputs(monkeypatch):
    from services.model_worker.kernels import triton_attention

    if not triton_attention.available():
        pytest.skip("triton is not installed")
    cuda = FakeCuda(monkeypatch)

    class OnGpu1:
        """Just what the launcher reads of a tensor on cuda:1."""
        device, is_cuda, dtype = torch.device("cuda", 1), True, torch.float32

        def __init__(self, *shape):
            self.shape = shape

        def stride(self, dim):
            return 1

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: cuda.calls.append(("launch", cuda.current))

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Kernel())
    q = OnGpu1(3, 4, 16)
    triton_attention.paged_attention(q, OnGpu1(2, 64, 16), OnGpu1(2, 64, 16), OnGpu1(4), OnGpu1(3),
                                     OnGpu1(3, 4), 16, 1, 0.25, out=OnGpu1(3, 4, 16))
    assert cuda.calls == [("launch", 1)]
