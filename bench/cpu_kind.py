"""Which CPU a benchmark ran on, for its JSON: the model name, and the kind its figures are filed under.

The same machine kind comes as a Xeon with AMX or as an AMD EPYC (Zen 4: AVX512-BF16 and VNNI, no
AMX), and the kernels a step runs differ between them, so every figure names its kind.
"""
from __future__ import annotations

import pathlib
import platform


def cpu_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        block = pathlib.Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}


def cpu_model() -> str:
    """The model name (a virtual machine may give no more than "AMD EPYC")."""
    return cpu_fields().get("model name") or platform.processor() or "unknown"


def cpu_kind(flags: list[str] | None = None) -> str:
    """"AMX" (tiles: the Xeons), "AVX512" (AVX-512 without tiles: Zen 4), or "x86" (neither).

    flags: /proc/cpuinfo's flags; None reads this machine's.
    """
    flags = cpu_fields().get("flags", "").split() if flags is None else flags
    return "AMX" if "amx_tile" in flags else "AVX512" if "avx512f" in flags else "x86"


def cpu_description() -> str:
    """The model name with its family and model numbers and its bf16/VNNI/AMX flags, for a report's header."""
    fields = cpu_fields()
    flags = fields.get("flags", "").split()
    features = ", ".join(f for f in ("avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8") if f in flags)
    return (f"{cpu_model()} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}; "
            f"{features or 'no avx512_bf16'})")
