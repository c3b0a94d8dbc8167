"""Qwen3's chat template as Qwen publishes it, fetched from PyPI for the tests (never kept in this tree).

llama.cpp keeps copies of published chat templates, fetched from the model hubs, and the
`llama-cpp-python` source distribution on PyPI carries llama.cpp whole. The tests compare our
renderer with transformers' on that template; the archive is pinned by its sha256, and only the one
member is kept, in the user's cache. `python -m tests.published_template` fetches it ahead of the tests
(`scripts/install.sh --dev` does).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import tarfile
import tempfile
import urllib.request

SDIST_URL = ("https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
             "llama_cpp_python-0.3.36.tar.gz")
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja"
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "vllm_v0" / "reference"


def published_qwen3_template() -> str:
    """The template's text (Qwen/Qwen3-0.6B's tokenizer_config.json `chat_template`), fetched once."""
    path = CACHE / pathlib.Path(MEMBER).name
    if not path.exists():
        _fetch(path)
    return path.read_text(encoding="utf-8")


def _fetch(path: pathlib.Path) -> None:
    with tempfile.TemporaryFile() as archive:
        digest = hashlib.sha256()
        with urllib.request.urlopen(SDIST_URL, timeout=120) as response:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                archive.write(chunk)
        if digest.hexdigest() != SDIST_SHA256:
            raise RuntimeError(f"{SDIST_URL}: sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")
        archive.seek(0)
        with tarfile.open(fileobj=archive, mode="r:gz") as tar:
            text = tar.extractfile(MEMBER).read()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_bytes(text)
    partial.replace(path)


if __name__ == "__main__":
    print(f"{len(published_qwen3_template())} characters of Qwen3's published chat template in {CACHE}")
