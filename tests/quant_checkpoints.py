"""8-bit copies of a random checkpoint, written here independently of the engine's quantizer, and their float32
dequantizations: what transformers loads as the reference for the engine on the 8-bit copy."""
from __future__ import annotations

import json
import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def is_linear(name: str, lm_head: bool = False) -> bool:
    parts = name.split(".")
    return parts[-1] == "weight" and (parts[-2] in LINEAR or (lm_head and parts[-2] == "lm_head"))


def fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: scale = amax / 448 (1 if all zero), q = float8_e4m3fn(w / scale)."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // block), -(-k // block))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            amax = weight[rows, cols].float().abs().max()
            scale = amax / 448 if amax > 0 else torch.tensor(1.0)
            scales[i, j] = scale
            q[rows, cols] = (weight[rows, cols].float() / scale).to(torch.float8_e4m3fn)
    return q, scales


def fp8_dequantized(q: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].float() * scales[i, j]
    return out


def int8_rows_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """Row by row: scale = amax / 127, q = round half to even(w / scale) in float32; returns q * scale."""
    out = torch.empty(weight.shape)
    for r, row in enumerate(weight.float()):
        amax = row.abs().max()
        scale = amax / 127 if amax > 0 else torch.tensor(1.0)
        out[r] = torch.round(row / scale).clamp(-127, 127) * scale
    return out


def _tensors(path: pathlib.Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(f) for f in sorted(path.glob("*.safetensors"))}


def _copy_side_files(src: pathlib.Path, dst: pathlib.Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)


def _write(dst: pathlib.Path, files: dict[str, dict[str, torch.Tensor]], sharded: bool) -> None:
    for name, tensors in files.items():
        save_file(tensors, dst / name, metadata={"format": "pt"})
    if sharded:
        weight_map = {t: name for name, tensors in files.items() for t in tensors}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_fp8(src: pathlib.Path, fp8_dir: pathlib.Path, dequantized_dir: pathlib.Path,
              quantization_config: dict | None = None) -> None:
    """src's linear layers as Qwen's FP8 format in fp8_dir (same files, a weight_scale_inv beside each
    weight), and the same checkpoint with those weights dequantized to float32 in dequantized_dir."""
    sharded = (src / "model.safetensors.index.json").exists()
    fp8_files, plain_files = {}, {}
    for file, tensors in _tensors(src).items():
        fp8_files[file], plain_files[file] = {}, {}
        for name, t in tensors.items():
            if is_linear(name):
                q, scales = fp8_blocks(t)
                fp8_files[file][name], fp8_files[file][name + "_scale_inv"] = q, scales
                plain_files[file][name] = fp8_dequantized(q, scales)
            else:
                fp8_files[file][name] = plain_files[file][name] = t
    for dst, files in ((fp8_dir, fp8_files), (dequantized_dir, plain_files)):
        _copy_side_files(src, dst)
        _write(dst, files, sharded)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config or FP8_CONFIG
    (fp8_dir / "config.json").write_text(json.dumps(config))


def write_dequantized(src: pathlib.Path, dst: pathlib.Path, fmt: str, lm_head: bool) -> None:
    """src with its linear layers (and lm_head if asked) replaced by their fp8-block or int8-row quantization,
    dequantized to float32: what the engine's quantize-on-load should compute with."""
    sharded = (src / "model.safetensors.index.json").exists()
    files = {}
    for file, tensors in _tensors(src).items():
        files[file] = {}
        for name, t in tensors.items():
            if is_linear(name, lm_head):
                t = fp8_dequantized(*fp8_blocks(t)) if fmt == "fp8" else int8_rows_dequantized(t)
            files[file][name] = t
    config = json.loads((src / "config.json").read_text())
    _copy_side_files(src, dst)
    if lm_head and config.get("tie_word_embeddings"):
        # A tied head quantized on load gets its own 8-bit copy; the embedding keeps the table as it was.
        for tensors in files.values():
            if "model.embed_tokens.weight" in tensors:
                embed = tensors["model.embed_tokens.weight"]
                tensors["lm_head.weight"] = (fp8_dequantized(*fp8_blocks(embed)) if fmt == "fp8"
                                             else int8_rows_dequantized(embed))
        config["tie_word_embeddings"] = False
        (dst / "config.json").write_text(json.dumps(config))
    _write(dst, files, sharded)
