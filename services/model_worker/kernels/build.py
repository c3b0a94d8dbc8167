"""Compiles a kernel's C file with the system compiler on first use and loads it through ctypes.

A library is compiled for the machine it runs on (-march=native) and cached under a name that
hashes the source, the headers beside it, the flags, the compiler's version and the CPU's feature
list, so a changed kernel, an upgraded compiler or another CPU gets a fresh build (about a second).
A cached library that no longer loads (a truncated write, a disk error) is rebuilt once before the
PyTorch path is taken. It links torch's own OpenMP runtime, so a kernel's threads are
the same pool, and the same thread count, as torch's: two runtimes in one process would each
keep a team of spinning threads on the same cores.
A cache directory or library that another user could have written is refused, not loaded: its code
would run inside the worker.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp"]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("VLLM_V0_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                          os.path.expanduser("~/.cache"), "vllm_v0")
    return pathlib.Path(root) / "kernels"


class UnsafeCacheError(RuntimeError):
    """The kernel cache, or a library in it, could have been written by another user."""


def check_private(path: pathlib.Path) -> None:
    """Raise UnsafeCacheError unless only this user (or root) can have put what is at `path` there.

    A cached library is loaded into the worker and runs as it, so a file or directory that another
    user can write is a way for them to run code as this user. Root-owned is trusted, as by ssh:
    root can change anything anyway, and a shared cache built ahead by root is safe to read.
    """
    info = os.lstat(path)
    kind = "directory" if os.path.isdir(path) else "file"
    uid = os.getuid()
    if stat.S_ISLNK(info.st_mode):
        # Whoever can write the folder holding a link can point it elsewhere at any time after a check.
        why = f"is a symbolic link (to {os.readlink(path)})"
        fix = ("replace the link with a directory of your own (`mkdir -m 700`), or set VLLM_V0_CACHE elsewhere"
               if kind == "directory" else "remove the link (the worker builds its kernel again)")
    elif info.st_uid not in (uid, 0):
        why = f"is owned by uid {info.st_uid}, not by this user (uid {uid}) or root"
        fix = "remove it (the worker builds its kernels again), or set VLLM_V0_CACHE to a directory of your own"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(name for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user"))
                           if info.st_mode & bit)
        why = f"is writable by {who} (mode {stat.filemode(info.st_mode)})"
        chmod = "chmod -R go-w" if kind == "directory" else "chmod go-w"
        fix = f"run `{chmod} {path}` if you trust what is in it, else remove it (the worker builds its kernels again)"
    else:
        return
    raise UnsafeCacheError(f"refusing the kernel cache {kind} {path}: it {why}, so another user could have "
                           f"replaced the code it loads; {fix}")


def cpu_features() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiler_version(compiler: str) -> str:
    """What `compiler --version` prints: the same name may be another compiler after an upgrade."""
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"the C compiler {compiler!r} does not run: {e}") from e
    return result.stdout + result.stderr


def cache_path(source: pathlib.Path, compiler: str) -> pathlib.Path:
    """Where the library built from `source` by `compiler` on this machine is cached."""
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(FLAGS).encode(), compiler.encode(),
                                     compiler_version(compiler).encode(), platform.machine().encode(),
                                     cpu_features().encode(), str(torch_lib).encode()])).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def build(source: pathlib.Path, compiler: str | None = None) -> pathlib.Path:
    """Compile the C file (or find it already compiled); raises RuntimeError if that fails."""
    compiler = compiler or os.environ.get("CC") or "gcc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (set CC to use another)")
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    target = cache_path(source, compiler)
    if not os.path.lexists(target.parent):
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(target.parent)
    if os.path.lexists(target):
        check_private(target)
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = pathlib.Path(tmp) / target.name
        gomp = [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        cmd = [compiler, *FLAGS, str(source), "-o", str(out), *gomp, "-lgomp", "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
        # The linker's mode follows the umask, which may let the group write (umask 002): the check above
        # would then refuse this very file on the next start.
        out.chmod(0o755)
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file
    return target


def load(source: pathlib.Path, what: str) -> ctypes.CDLL | None:
    """The compiled library, or None (with a warning naming `what` falls back) where it cannot be built."""
    try:
        path = build(source)
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            # The cache outlives processes, so one bad file would otherwise cost every later start its kernel.
            log.warning("%s: cached C kernel %s does not load (%s); rebuilding it", what, path, e)
            path.unlink(missing_ok=True)
            return ctypes.CDLL(str(build(source)))
    except (RuntimeError, OSError) as e:
        log.warning("%s: C kernel unavailable, using the PyTorch path (slower): %s", what, e)
        return None
