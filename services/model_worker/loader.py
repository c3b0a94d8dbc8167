"""Load a Qwen3 checkpoint's safetensors weights straight into the model on its device and dtype."""
from __future__ import annotations

import json
import logging
import pathlib
import time
from collections import defaultdict

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from services.model_worker import hugepages
from services.model_worker.config import Qwen3Config
from services.model_worker.models.qwen3 import Qwen3ForCausalLM
from services.model_worker.parallel import TensorParallel

log = logging.getLogger(__name__)

# Tensors some exporters add that carry nothing the model needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LoadError(ValueError):
    """The checkpoint's weights are missing, unreadable or do not fit the config."""


def weight_files(checkpoint_dir: pathlib.Path) -> dict[str, list[str]]:
    """Map each safetensors file to the tensor names it holds (as the index claims, or as read)."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files: dict[str, list[str]] = defaultdict(list)
        for name, file in weight_map.items():
            files[file].append(name)
        for file in files:
            if not (checkpoint_dir / file).exists():
                raise LoadError(f"{index.name} lists {file}, which is not in {checkpoint_dir}")
        return dict(files)
    single = checkpoint_dir / "model.safetensors"
    if single.exists():
        return {single.name: []}
    pickled = sorted(p.name for p in checkpoint_dir.glob("*.bin")) + sorted(p.name for p in checkpoint_dir.glob("*.pt"))
    hint = f" ({', '.join(pickled)} are pickle files and are never loaded)" if pickled else ""
    raise LoadError(f"no model.safetensors or model.safetensors.index.json in {checkpoint_dir}{hint}")


def _target(model: Qwen3ForCausalLM, name: str) -> tuple[str, torch.Tensor, slice | None, int | None] | None:
    """Our parameter (and the slice of it) that a checkpoint tensor fills, and the dim it is split
    along across tensor-parallel ranks (None: whole on every rank); None if it has no place."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    shard = None
    if module_name in model.packed_modules:
        fused, shard = model.packed_modules[module_name]
        module_path = ".".join(filter(None, (parent, fused)))
    try:
        param = getattr(model.get_submodule(module_path), leaf)
        # The fused projection's owner (attention or MLP) knows where each part goes.
        part = None if shard is None else model.get_submodule(parent).shard_slice(shard)
    except AttributeError:
        return None
    if not isinstance(param, torch.Tensor):
        return None
    split_dim = model.tp_split_dims.get(module_path.rpartition(".")[2])
    if split_dim is not None and split_dim >= param.dim():
        split_dim = None  # a row-parallel layer's bias: whole, added by rank 0 alone (see _read_shard)
    return f"{module_path}.{leaf}", param, part, split_dim


def _read_shard(f, name: str, dest: torch.Tensor, split_dim: int | None, tp: TensorParallel,
                row_parallel_bias: bool) -> torch.Tensor | str:
    """This rank's slice of a checkpoint tensor, read alone from the file; or why its shape is wrong."""
    shape = list(f.get_slice(name).get_shape())
    want = list(dest.shape)
    if split_dim is not None:
        want[split_dim] *= tp.size
    if shape != want:
        return f"{name}: checkpoint {shape}, config expects {want}"
    if split_dim is None:
        if row_parallel_bias and tp.rank != 0:
            return torch.zeros_like(dest)  # the ranks' outputs are summed: the bias must count once
        return f.get_tensor(name)
    rows = dest.shape[split_dim]
    index = [slice(None)] * len(shape)
    index[split_dim] = slice(tp.rank * rows, (tp.rank + 1) * rows)
    return f.get_slice(name)[tuple(index)]


def expected_tensors(model: Qwen3ForCausalLM) -> set[str]:
    """Checkpoint names the model needs: every parameter, fused ones split back into their parts."""
    unfused = {fused: [part for part, (f, _) in model.packed_modules.items() if f == fused]
               for fused, _ in model.packed_modules.values()}
    names = set()
    for name, _ in model.named_parameters():  # shared (tied) parameters are listed once
        module_path, _, leaf = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        for part in unfused.get(module_name, [module_name]):
            names.add(".".join(filter(None, (parent, part, leaf))))
    return names


def load_model(checkpoint_dir: str | pathlib.Path, config: Qwen3Config, device: torch.device,
               dtype: torch.dtype, tp: TensorParallel | None = None, huge_pages: bool = True) -> Qwen3ForCausalLM:
    """The model, or this rank's shard of it: each rank reads only its slices of the tensors.

    huge_pages: on CPU, the weights go to memory advised for 2 MiB pages (hugepages.py).
    """
    checkpoint_dir = pathlib.Path(checkpoint_dir)
    tp = tp or TensorParallel()
    start = time.perf_counter()
    files = weight_files(checkpoint_dir)
    # Build without memory, then allocate once on the target device: no second full copy is ever held.
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(config, tp)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if huge_pages and device.type == "cpu":
        hugepages.move_parameters(model)  # before the weights are read in, so they land there
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    expected = expected_tensors(model)
    seen: set[str] = set()
    unexpected: list[str] = []
    misshapen: list[str] = []
    total_bytes = sum((checkpoint_dir / f).stat().st_size for f in files)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights", delay=1.0,
              disable=None) as progress:
        for file in files:
            path = checkpoint_dir / file
            try:
                with safe_open(str(path), framework="pt", device=str(device)) as f:
                    for name in f.keys():
                        if name.endswith(IGNORED_SUFFIXES):
                            continue
                        if name == "lm_head.weight" and config.tie_word_embeddings:
                            continue  # tied: the embedding is the head
                        target = _target(model, name)
                        if target is None or name not in expected:
                            unexpected.append(name)
                            continue
                        our_name, param, part, split_dim = target
                        dest = param.data if part is None else param.data[part]
                        row_parallel_bias = (our_name.endswith(".bias")
                                             and model.tp_split_dims.get(our_name.split(".")[-2]) == 1)
                        tensor = _read_shard(f, name, dest, split_dim, tp, row_parallel_bias)
                        if isinstance(tensor, str):
                            misshapen.append(tensor)
                            continue
                        dest.copy_(tensor)
                        seen.add(name)
                        progress.update(tensor.numel() * tensor.element_size())
            except (SafetensorError, OSError) as e:
                raise LoadError(f"cannot read {path}: {e} (the file may be truncated or corrupt)") from None
    missing = sorted(expected - seen)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors (not part of Qwen3ForCausalLM): {_some(sorted(unexpected))}")
    if misshapen:
        problems.append(f"wrong shapes: {_some(misshapen)}")
    if problems:
        raise LoadError(f"checkpoint {checkpoint_dir} does not match its config.json: " + "; ".join(problems))
    model.eval().requires_grad_(False)
    log.info("loaded %d tensors (%.2f GB) from %s to %s as %s in %.1f s", len(seen), total_bytes / 1e9,
             checkpoint_dir, device, str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return model


def _some(items: list[str], limit: int = 8) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def resolve_device(name: str) -> torch.device:
    """The torch device for --device, checked at start: a missing or out-of-range GPU fails here, with the reason."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LoadError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise LoadError(f"--device {name}: only cpu and cuda are supported")
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        # The usual cause in a container: a torch build for a newer CUDA than the host's driver supports.
        build = f"this torch is built for CUDA {torch.version.cuda}" if torch.version.cuda else "this torch is a CPU build"
        raise LoadError(f"--device {name} was asked for, but no CUDA GPU is visible to torch ({build}; check "
                        "nvidia-smi, the driver version this build needs, and that the GPU is passed to the container)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise LoadError(f"--device {name}: there is no GPU {device.index}; torch sees {count} "
                        f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them from 0)")
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config: Qwen3Config, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype on a GPU; on a CPU, bfloat16 where it is supported natively."""
    if name != "auto":
        if name not in DTYPES:
            raise LoadError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda":
        return DTYPES.get(config.torch_dtype, torch.bfloat16)
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
