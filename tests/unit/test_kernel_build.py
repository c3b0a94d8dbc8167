"""The C-kernel cache: keyed by the compiler's version, and a cached library that does not load is rebuilt once."""
import ctypes
import os
import pathlib
import shutil

import pytest

from services.model_worker.kernels import build

GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="the kernels are built with gcc")


@pytest.fixture()
def source(tmp_path, monkeypatch):
    """A one-function C file (quick to compile) and an empty kernel cache of its own."""
    monkeypatch.setenv("VLLM_V0_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "src" / "answer.c"
    path.parent.mkdir()
    path.write_text("int answer(void) { return 42; }\n")
    return path


def fake_compiler(folder: pathlib.Path, version: str, compile_step: str = f'exec "{GCC}" "$@"') -> pathlib.Path:
    """A `cc` in `folder` that reports `version` and compiles with `compile_step`; it logs each compile."""
    folder.mkdir(parents=True)
    script = folder / "cc"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\n'
                      f'echo compiled >> "{folder}/compiles"\n{compile_step}\n')
    script.chmod(0o755)
    return folder


def use_compiler(monkeypatch, folder: pathlib.Path) -> None:
    # The same name, `cc`, on PATH for both versions: what an upgrade in place looks like.
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CC", "cc")


def compiles(folder: pathlib.Path) -> int:
    log = folder / "compiles"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_an_upgraded_compiler_of_the_same_name_gets_its_own_build(source, tmp_path, monkeypatch):
    old = fake_compiler(tmp_path / "old", "gcc (Debian 12.2.0-14) 12.2.0")
    new = fake_compiler(tmp_path / "new", "gcc (Debian 14.2.0-19) 14.2.0")
    with monkeypatch.context() as m:
        use_compiler(m, old)
        old_path = build.build(source)
        assert build.build(source) == old_path and compiles(old) == 1  # cached for the same version
    use_compiler(monkeypatch, new)
    new_path = build.build(source)
    assert new_path != old_path and compiles(new) == 1
    assert ctypes.CDLL(str(new_path)).answer() == 42


def test_a_cached_library_that_does_not_load_is_rebuilt(source, caplog):
    path = build.build(source)
    path.write_bytes(b"not an ELF file, as after a write cut short")
    library = build.load(source, "answer")
    assert library is not None and library.answer() == 42
    assert "does not load" in caplog.text and "rebuilding it" in caplog.text
    assert "C kernel unavailable" not in caplog.text


def test_a_library_that_still_does_not_load_is_rebuilt_only_once(source, tmp_path, monkeypatch, caplog):
    # A compiler whose output never loads: one rebuild, then the PyTorch path.
    broken = fake_compiler(tmp_path / "broken", "cc 1.0",
                           'while [ "$1" != "-o" ]; do shift; done; echo garbage > "$2"')
    use_compiler(monkeypatch, broken)
    assert build.load(source, "answer") is None
    assert compiles(broken) == 2
    assert "answer: C kernel unavailable, using the PyTorch path" in caplog.text
