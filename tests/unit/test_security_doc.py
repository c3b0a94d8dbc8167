"""docs/security-and-operations.md says of API keys what the three services' code does."""
import importlib
import pathlib
import re

import pytest

from rpcserver.auth import ApiKeyInterceptor, auth_interceptors

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security-and-operations.md"
MAINS = ["gateway.main", "services.tokenizer.main", "services.model_worker.main"]


@pytest.mark.parametrize("module", MAINS)
def test_every_service_checks_a_key_when_given_one(module, monkeypatch):
    monkeypatch.delenv("VLLM_V0_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_V0_API_KEY_FILE", raising=False)
    parse_args = importlib.import_module(module).parse_args
    assert [type(i) for i in auth_interceptors(parse_args(["--api-key", "secret"]))] == [ApiKeyInterceptor]
    assert auth_interceptors(parse_args([])) == []


def sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in re.split(r"(?<=[.;])\s", text)]


def test_the_doc_says_every_service_checks_a_key():
    text = DOC.read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in text.splitlines()
            if line.startswith("| `--api-key")}
    assert rows == {"`--api-key`": "all", "`--api-key-file`": "all"}
    # What the doc said while every main.py already took the flag: "only the gateway turns it on".
    only_gateway = [s for s in sentences(text)
                    if re.search(r"\bonly the gateway\b[^.;]*\b(turns it on|checks|requires)\b", s, re.I)]
    assert not only_gateway, only_gateway
    assert "a tokenizer or worker started with a key refuses every caller without it" in " ".join(text.split())
