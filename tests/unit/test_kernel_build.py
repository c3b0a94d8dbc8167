"""The C-kernel cache: keyed by the compiler's version, a library that does not load rebuilt once, and a
cache another user could have written refused."""
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


@pytest.mark.parametrize("mode, why", [(0o775, "writable by its group"), (0o757, "writable by every user"),
                                       (0o777, "writable by its group and every user")],
                         ids=["0o775", "0o757", "0o777"])
def test_a_cache_directory_others_can_write_is_refused(source, mode, why):
    path = build.build(source)
    path.parent.chmod(mode)
    with pytest.raises(build.UnsafeCacheError) as refused:
        build.build(source)
    message = str(refused.value)
    assert f"kernel cache directory {path.parent}" in message and why in message
    assert f"chmod -R go-w {path.parent}" in message  # what to do


@pytest.mark.parametrize("mode", [0o775, 0o757], ids=oct)
def test_a_cached_library_others_can_write_is_refused_and_not_loaded(source, mode, caplog):
    path = build.build(source)
    path.chmod(mode)
    with pytest.raises(build.UnsafeCacheError, match=f"kernel cache file {path}: it is writable by"):
        build.build(source)
    # load() takes the PyTorch path instead of running the file, and says why and where.
    assert build.load(source, "answer") is None
    assert "answer: C kernel unavailable" in caplog.text and str(path) in caplog.text
    assert "chmod go-w" in caplog.text


def test_a_private_cache_is_used_as_it_is(source, tmp_path, monkeypatch):
    use_compiler(monkeypatch, fake_compiler(tmp_path / "cc", "cc 1.0"))
    path = build.build(source)
    path.parent.chmod(0o700)
    path.chmod(0o500)
    assert build.build(source) == path and compiles(tmp_path / "cc") == 1  # found, not built again
    assert ctypes.CDLL(str(path)).answer() == 42


def test_a_new_cache_is_private_whatever_the_umask(source):
    old = os.umask(0o002)  # a shared group's umask: files group-writable by default
    try:
        path = build.build(source)
    finally:
        os.umask(old)
    assert path.parent.stat().st_mode & 0o077 == 0
    assert path.stat().st_mode & 0o022 == 0
    assert build.build(source) == path  # and a later start accepts it


def with_owner(monkeypatch, owner: int, under: pathlib.Path) -> None:
    """os.lstat reports `owner` as the owner of everything under `under` (tests run as root, which owns all)."""
    real = os.lstat

    def lstat(path, *args, **kwargs):
        info = real(path, *args, **kwargs)
        if not pathlib.Path(path).is_relative_to(under):
            return info
        fields = list(info[:10])
        fields[4] = owner  # st_uid
        return os.stat_result(fields)

    monkeypatch.setattr(os, "lstat", lstat)


@pytest.mark.parametrize("what", ["directory", "file"])
def test_a_cache_another_user_owns_is_refused(source, monkeypatch, what):
    path = build.build(source)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    with_owner(monkeypatch, 1001, path if what == "file" else path.parent)
    with pytest.raises(build.UnsafeCacheError) as refused:
        build.build(source)
    target = path if what == "file" else path.parent
    assert f"kernel cache {what} {target}: it is owned by uid 1001, not by this user (uid 1000) or root" \
        in str(refused.value)
    assert "VLLM_V0_CACHE" in str(refused.value)


@pytest.mark.parametrize("user, owner", [(1000, 1000), (1000, 0), (0, 0)])
def test_a_cache_of_this_user_or_root_is_accepted(source, monkeypatch, user, owner):
    # Root's is trusted whoever runs: root could change the cache anyway, and a cache root built ahead is safe.
    path = build.build(source)
    monkeypatch.setattr(os, "getuid", lambda: user)
    with_owner(monkeypatch, owner, path.parent)
    assert build.build(source) == path


def test_a_root_user_refuses_another_users_cache(source, monkeypatch):
    path = build.build(source)
    monkeypatch.setattr(os, "getuid", lambda: 0)
    with_owner(monkeypatch, 1000, path)
    with pytest.raises(build.UnsafeCacheError, match="owned by uid 1000, not by this user"):
        build.build(source)


def test_a_symlinked_cache_directory_or_library_is_refused(source, tmp_path):
    path = build.build(source)
    elsewhere = tmp_path / "elsewhere"
    path.parent.rename(elsewhere)
    path.parent.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(build.UnsafeCacheError, match=f"kernel cache directory {path.parent}: it is a symbolic link"):
        build.build(source)
    path.parent.unlink()
    elsewhere.rename(path.parent)
    library = tmp_path / "answer.so"
    path.rename(library)
    path.symlink_to(library)
    with pytest.raises(build.UnsafeCacheError, match=f"kernel cache file {path}: it is a symbolic link"):
        build.build(source)
