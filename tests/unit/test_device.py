"""--device is resolved and checked against the GPUs torch can see, before any weights load (GPUs faked on CPU)."""
import pytest
import torch

from services.model_worker.loader import LoadError, resolve_device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees `n` CUDA devices (0: none)."""
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


def test_auto_is_cuda_when_a_gpu_is_visible(gpus):
    gpus(1)
    assert resolve_device("auto") == torch.device("cuda")
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")


def test_each_visible_index_is_accepted(gpus):
    gpus(2)
    assert resolve_device("cuda") == torch.device("cuda")
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
