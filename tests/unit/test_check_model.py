"""checkpoint.check: the preflight that stops `docker compose up` when MODEL is not a checkpoint."""
import pytest

from demo.vocab import write_tokenizer_files
from checkpoint.check import main, problems


@pytest.fixture
def checkpoint(tmp_path):
    """A directory with every file the services read (the weights' content is not the check's business)."""
    write_tokenizer_files(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_a_complete_checkpoint_passes(checkpoint, capsys):
    assert problems(str(checkpoint)) == []
    assert main(["--model", str(checkpoint)]) == 0
    assert capsys.readouterr().err == ""


def test_a_sharded_checkpoint_passes(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors.index.json").write_text("{}")
    assert problems(str(checkpoint)) == []


def test_a_hub_id_is_left_to_the_download(capsys):
    assert main(["--model", "Qwen/Qwen3-0.6B"]) == 0
    assert "hub id" in capsys.readouterr().out


def test_a_missing_directory_prints_the_hint(tmp_path, capsys):
    missing = tmp_path / "demo"
    assert main(["--model", str(missing), "--hint", "run the demo profile"]) == 1
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err
    assert err.rstrip().endswith("run the demo profile")


@pytest.mark.parametrize("removed", ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"])
def test_each_missing_file_is_named(checkpoint, removed, capsys):
    (checkpoint / removed).unlink()
    assert main(["--model", str(checkpoint)]) == 1
    err = capsys.readouterr().err
    expected = "model.safetensors or model.safetensors.index.json" if removed == "model.safetensors" else removed
    assert f"{checkpoint} has no {expected}" in err
    assert err.count(" has no ") == 1


def test_a_file_is_not_a_checkpoint(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    assert problems(str(file)) == [f"{file} is not a directory"]


def test_an_empty_directory_lists_everything_missing(tmp_path):
    assert len(problems(str(tmp_path))) == 4
