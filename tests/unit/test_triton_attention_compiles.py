"""The attention kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter runs the kernels' Python, which accepts things the compiler refuses (types that
differ between branches, ops on the wrong kinds of values); Triton's wheel carries ptxas, so the
whole compile to a cubin runs here. In a subprocess: the interpreter, once chosen, is for the process.
"""
import os
import pathlib
import subprocess
import sys

import pytest

from services.model_worker.kernels import triton_attention

ROOT = pathlib.Path(__file__).resolve().parents[2]


def compile_all() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.model_worker.kernels import triton_attention as kernels

    def build(fn, pointer_types: dict, constants: dict) -> str:
        signature = {}
        for name in fn.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = "*" + pointer_types.get(name, pointer_types["*"])
            else:
                signature[name] = "fp32" if name == "scale" else "i32"
        source = ASTSource(fn=fn, signature=signature,
                           constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
        return fn.__name__

    built = []
    for dtype in ("bf16", "fp32"):
        for split in (False, True):
            integers = dict.fromkeys(("query_start_ptr", "context_lens_ptr", "block_tables_ptr"), "i32")
            scratch = dict.fromkeys(("part_out_ptr", "lse_ptr"), "fp32" if split else dtype)
            built.append(build(kernels._paged_attention_kernel, {"*": dtype, **integers, **scratch},
                               dict(GROUP=2, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_M=kernels.BLOCK_M,
                                    BLOCK_N=kernels.BLOCK_N, IEEE=dtype == "fp32", UPCAST=False, SPLIT=split,
                                    MIN_PARTITION=kernels.MIN_PARTITION)))
        built.append(build(kernels._combine_partitions_kernel, {"*": "fp32", "out_ptr": dtype},
                           dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_P=64, CHUNK=kernels.COMBINE_CHUNK)))
    return built


@pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")
def test_the_attention_kernels_compile_for_sm90(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["_paged_attention_kernel"] * 2 + ["_combine_partitions_kernel"] \
        + ["_paged_attention_kernel"] * 2 + ["_combine_partitions_kernel"]


if __name__ == "__main__":
    print("\n".join(compile_all()))
