"""The worker refuses out-of-range flags at start, naming the flag, instead of failing later."""
import os

import pytest

from services.model_worker.main import engine_config, parse_args


@pytest.mark.parametrize("flag,value,message", [
    ("--block-size", "0", "--block-size must be >= 1, got 0"),
    ("--kv-cache-bytes", "0", "--kv-cache-bytes must be >= 1, got 0"),
    ("--gpu-memory-utilization", "0", "--gpu-memory-utilization must be in (0, 1], got 0.0"),
    ("--gpu-memory-utilization", "1.5", "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    ("--max-model-len", "-1", "--max-model-len must be >= 0 (0: the model's own limit), got -1"),
    ("--max-num-seqs", "0", "--max-num-seqs must be >= 1, got 0"),
])
def test_out_of_range_flags_are_refused_by_name(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_and_edges_are_accepted():
    args = parse_args(["--gpu-memory-utilization", "1", "--block-size", "1", "--max-model-len", "0"])
    config = engine_config(args)
    assert (config.block_size, config.gpu_memory_utilization, config.max_model_len) == (1, 1.0, None)


@pytest.mark.parametrize("value, size", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                         ("4096", 4096), ("64kib", 64 << 10)])
def test_kv_cache_bytes_takes_sizes_with_units(value, size, monkeypatch):
    assert parse_args(["--kv-cache-bytes", value]).kv_cache_bytes == size
    monkeypatch.setenv("VLLM_V0_KV_CACHE_BYTES", value)
    assert parse_args([]).kv_cache_bytes == size


def test_a_size_that_is_not_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-bytes", "2 lots"])
    assert "--kv-cache-bytes" in capsys.readouterr().err


def test_enforce_eager_reaches_the_engine():
    assert engine_config(parse_args([])).enforce_eager is False
    assert engine_config(parse_args(["--enforce-eager"])).enforce_eager is True


@pytest.mark.parametrize("value, message", [
    ("1-", "is not a CPU list"), ("a", "is not a CPU list"), ("3-1", "runs backwards"), ("0,,1", "is not a CPU list"),
    ("4096", "CPU 4096 is not available to this process"),
])
def test_engine_cpus_must_be_a_list_of_cpus_this_process_may_use(capsys, value, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--engine-cpus", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--engine-cpus" in err and message in err


def test_engine_cpus_defaults_to_all_and_takes_available_cpus(monkeypatch):
    assert parse_args([]).engine_cpus is None
    cpu = min(os.sched_getaffinity(0))
    assert parse_args(["--engine-cpus", str(cpu)]).engine_cpus == {cpu}
    monkeypatch.setenv("VLLM_V0_ENGINE_CPUS", str(cpu))
    assert parse_args([]).engine_cpus == {cpu}


@pytest.mark.parametrize("flags, tokens", [
    (["--device", "cpu"], 768), (["--device", "cuda"], 2048), (["--device", "cuda:1"], 2048),
    (["--device", "cpu", "--max-num-seqs", "1024"], 1024),  # never below the sequences a step may hold
    (["--device", "cpu", "--max-num-batched-tokens", "4096"], 4096),
])
def test_the_step_token_budget_defaults_by_device(flags, tokens):
    assert engine_config(parse_args(flags)).limits.max_num_batched_tokens == tokens


def test_int8_activations_is_on_unless_turned_off_by_flag_or_environment(monkeypatch):
    assert engine_config(parse_args([])).int8_activations is True
    assert engine_config(parse_args(["--no-int8-activations"])).int8_activations is False
    monkeypatch.setenv("VLLM_V0_INT8_ACTIVATIONS", "0")
    assert engine_config(parse_args([])).int8_activations is False


def test_vnni_weights_are_used_where_they_run_unless_turned_off(monkeypatch):
    assert engine_config(parse_args([])).vnni_weights is None  # None: where the CPU and compiler allow
    assert engine_config(parse_args(["--no-vnni-weights"])).vnni_weights is False
    monkeypatch.setenv("VLLM_V0_VNNI_WEIGHTS", "0")
    assert engine_config(parse_args([])).vnni_weights is False
