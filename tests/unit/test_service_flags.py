"""Flags every service shares: --version, and range checks that name the flag at start."""
import pathlib
import re

import pytest

from gateway.main import parse_args as gateway_args
from services.model_worker.main import parse_args as worker_args
from services.tokenizer.main import parse_args as tokenizer_args
from rpcserver.version import VERSION

SERVICES = {"gateway": gateway_args, "tokenizer": tokenizer_args, "worker": worker_args}


@pytest.mark.parametrize("name", SERVICES)
def test_version(name, capsys):
    with pytest.raises(SystemExit) as done:
        SERVICES[name](["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip().endswith(f"(vllm-v0) {VERSION}")


@pytest.mark.parametrize("name", SERVICES)
@pytest.mark.parametrize("flag, value, message", [
    ("--port", "70000", "--port must be in [0, 65535], got 70000"),
    ("--max-message-bytes", "0", "--max-message-bytes must be >= 1, got 0"),
    ("--grace-period", "-1", "--grace-period must be >= 0, got -1.0"),
    ("--keepalive-time", "0", "--keepalive-time must be >= 0.001, got 0.0"),
])
def test_server_flags_out_of_range_are_refused_by_name(name, flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        SERVICES[name]([flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-logprobs", "-1", "--max-logprobs must be >= 0, got -1"),
    ("--max-stop-string-chars", "0", "--max-stop-string-chars must be >= 1, got 0"),
    ("--max-prompt-chars", "0", "--max-prompt-chars must be >= 1, got 0"),
    ("--max-tokens-limit", "-5", "--max-tokens-limit must be >= 0, got -5"),
    ("--health-interval", "0", "--health-interval must be >= 0.01, got 0.0"),
    ("--http-request-timeout", "-1", "--http-request-timeout must be >= 0, got -1.0"),
])
def test_gateway_flags_out_of_range_are_refused_by_name(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gateway_args([flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-decode-streams", "0", "--max-decode-streams must be >= 1, got 0"),
    ("--decode-stream-idle-timeout", "-1", "--decode-stream-idle-timeout must be >= 0, got -1.0"),
])
def test_tokenizer_flags_out_of_range_are_refused_by_name(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        tokenizer_args([flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_max_message_bytes_takes_a_size():
    assert tokenizer_args(["--max-message-bytes", "16MiB"]).max_message_bytes == 16 << 20


def test_http_requests_have_a_deadline_by_default():
    assert gateway_args([]).http_request_timeout == 600
    assert gateway_args(["--http-request-timeout", "0"]).http_request_timeout == 0


def documented_flags() -> set[str]:
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    return set(re.findall(r"`(--[a-z0-9-]+)", text))


@pytest.mark.parametrize("name", SERVICES)
def test_every_flag_is_in_the_configuration_reference(name, capsys, monkeypatch):
    """docs/configuration.md is the reference the README points to: a new flag goes in it."""
    monkeypatch.setenv("COLUMNS", "10000")  # no flag name broken across lines
    with pytest.raises(SystemExit):
        SERVICES[name](["--help"])
    flags = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", capsys.readouterr().out))
    flags -= {"--help", "--version"}
    assert flags, "no flags read from --help"
    # `--no-x` is documented beside its `--x`
    missing = sorted(f for f in flags if f not in documented_flags()
                     and not (f.startswith("--no-") and "--" + f[5:] in documented_flags()))
    assert not missing, f"{name}: flags missing from docs/configuration.md: {missing}"
