"""The worker refuses out-of-range flags at start, naming the flag, instead of failing later."""
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


def test_enforce_eager_reaches_the_engine():
    assert engine_config(parse_args([])).enforce_eager is False
    assert engine_config(parse_args(["--enforce-eager"])).enforce_eager is True
