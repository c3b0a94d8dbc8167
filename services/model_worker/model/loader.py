"""Load a Qwen3 checkpoint's safetensors weights straight into the model on its device and dtype."""
from __future__ import annotations

import json
import logging
import math
import pathlib
import time
from collections import defaultdict

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from services.model_worker.config.model import Qwen3Config
from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.host import hugepages
from services.model_worker.model.layers.linear import LinearMethod, use_head_method
from services.model_worker.model.layers.weights import WeightShapeError, read_whole
from services.model_worker.model.qwen3 import Qwen3ForCausalLM
from services.model_worker.model.qwen3_moe import Qwen3MoeForCausalLM

log = logging.getLogger(__name__)

# The model class for each architecture config.json may name (config/model.py admits the same ones).
MODELS: dict[str, type[Qwen3ForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Tensors some exporters add that carry nothing the model needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# An fp8 KV cache's per-layer scales: read where the checkpoint has them, 1.0 where it does not.
OPTIONAL_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale")
# A checkpoint saved from the bare decoder (Qwen3Model, as the published Qwen3-Embedding ones are) names its tensors
# without the "model." prefix; read as the causal LM's, its head tied to the embedding where the config says so.
BARE_DECODER_ROOTS = ("embed_tokens.", "layers.", "norm.")


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


def _target(model: Qwen3ForCausalLM, name: str) -> tuple[nn.Module, str, object] | None:
    """The module a checkpoint tensor fills, the parameter's name in it, and the shard of a fused
    parameter it is (None: all of it); None if the tensor has no place in the model."""
    special = getattr(model, "checkpoint_target", None)  # names a model maps itself (experts)
    if special is not None and (found := special(name)) is not None:
        return found
    module_path, _, leaf = name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    shard = None
    if module_name in model.packed_modules:
        fused, shard = model.packed_modules[module_name]
        module_path = ".".join(filter(None, (parent, fused)))
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return None
    if not isinstance(getattr(module, leaf, None), torch.Tensor):
        return None
    return module, leaf, shard


def _load_tensor(module: nn.Module, leaf: str, source, shard) -> None:
    """The module reads its slice (layers with a weight_loader: model/layers/); anything else is whole."""
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        loader(leaf, source, shard)
    else:
        param = getattr(module, leaf).data
        param.copy_(read_whole(source, param))


def expected_tensors(model: Qwen3ForCausalLM) -> set[str]:
    """Checkpoint names the model needs: every parameter, fused ones split back into their parts."""
    unfused = {fused: [part for part, (f, _) in model.packed_modules.items() if f == fused]
               for fused, _ in model.packed_modules.values()}
    names = set()
    special = getattr(model, "checkpoint_names", lambda name: None)
    for name, _ in model.named_parameters():  # shared (tied) parameters are listed once
        if (parts := special(name)) is not None:
            names.update(parts)
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        for part in unfused.get(module_name, [module_name]):
            names.add(".".join(filter(None, (parent, part, leaf))))
    return names


def load_model(checkpoint_dir: str | pathlib.Path, config: Qwen3Config, device: torch.device,
               dtype: torch.dtype, tp: TensorParallel | None = None, huge_pages: bool = True,
               linear: LinearMethod | None = None, head_linear: LinearMethod | None = None) -> Qwen3ForCausalLM:
    """The model, or this rank's shard of it: each rank reads only its slices of the tensors.

    huge_pages: on CPU, the weights go to memory advised for 2 MiB pages (host/hugepages.py).
    linear: the linear layers' weight format (default: plain), applied once the weights are in.
    head_linear: the vocab projection's, where it differs (8-bit layers with a bf16 head).
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
            model = MODELS[config.architecture](config, tp, linear)
            if head_linear is not None and head_linear is not linear:
                use_head_method(model.lm_head, head_linear)
    finally:
        torch.set_default_dtype(previous_dtype)
    model.to_empty(device=device)
    # A bare decoder saved without a head whose config does not tie one (Qwen3-Embedding-4B and -8B) pools only:
    # its head is tied to the embedding (nothing to read), and the engine refuses to generate or score with it.
    headless = not config.tie_word_embeddings and _headless_bare_decoder(checkpoint_dir, files)
    tied = config.tie_word_embeddings or headless
    model.has_lm_head = not headless
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if huge_pages and device.type == "cpu":
        hugepages.move_parameters(model)  # before the weights are read in, so they land there
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()

    expected = expected_tensors(model)
    seen: set[str] = set()
    covered = getattr(model, "checkpoint_covers", lambda name: [name])
    unexpected: list[str] = []
    misshapen: list[str] = []
    total_bytes = sum((checkpoint_dir / f).stat().st_size for f in files)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights", delay=1.0,
              disable=None) as progress:
        for file in files:
            path = checkpoint_dir / file
            try:
                with safe_open(str(path), framework="pt", device=str(device)) as f:
                    for stored in f.keys():
                        name = "model." + stored if stored.startswith(BARE_DECODER_ROOTS) else stored
                        if name.endswith(IGNORED_SUFFIXES):
                            continue
                        if name == "lm_head.weight" and tied:
                            continue  # tied: the embedding is the head
                        target = _target(model, name)
                        if target is not None and name.endswith(OPTIONAL_SUFFIXES):
                            scale = f.get_tensor(stored).float()
                            if scale.numel() != 1:
                                misshapen.append(f"{name}: {list(scale.shape)}, a KV cache scale is one value")
                                continue
                            getattr(target[0], target[1]).copy_(scale.reshape(1))
                            continue
                        covers = covered(name)
                        if target is None or not expected.issuperset(covers):
                            unexpected.append(name)
                            continue
                        source = f.get_slice(stored)
                        try:
                            _load_tensor(*target[:2], source, target[2])
                        except WeightShapeError as e:
                            misshapen.append(f"{name}: {e}")
                            continue
                        seen.update(covers)
                        progress.update(math.prod(source.get_shape()) * dtype_bytes(source.get_dtype()))
            except (SafetensorError, OSError) as e:
                raise LoadError(f"cannot read {path}: {e} (the file may be truncated or corrupt)") from None
    missing = sorted(expected - seen)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors (not part of {config.architecture}): {_some(sorted(unexpected))}")
    if misshapen:
        problems.append(f"wrong shapes: {_some(misshapen)}")
    if problems:
        raise LoadError(f"checkpoint {checkpoint_dir} does not match its config.json: " + "; ".join(problems))
    model.eval().requires_grad_(False)
    loaded = {p.data_ptr() for p in model.parameters()}
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()  # the layer's weight format (model/layers/linear.py)
    if tied:
        model.model.embed_tokens.share_with_head(model.lm_head)  # the head may have reordered their weight
    if huge_pages and device.type == "cpu" and any(p.data_ptr() not in loaded for p in model.parameters()):
        hugepages.rehome_parameters(model)  # weights replaced after loading (quantized): free the loaded ones
    log.info("loaded %d tensors (%.2f GB) from %s to %s as %s in %.1f s", len(seen), total_bytes / 1e9,
             checkpoint_dir, device, str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return model


def _headless_bare_decoder(checkpoint_dir: pathlib.Path, files: dict[str, list[str]]) -> bool:
    """Whether the checkpoint is a bare decoder (no "model." prefix) with no lm_head.weight: an embedding model's
    layout. A causal LM's checkpoint missing its head stays an error. Names from the index, else the file's header."""
    names: list[str] = [name for listed in files.values() for name in listed]
    if not names:
        try:
            with safe_open(str(checkpoint_dir / next(iter(files))), framework="pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError):
            return False  # unreadable: the load below says why
    return "lm_head.weight" not in names and any(name.startswith(BARE_DECODER_ROOTS) for name in names)


def _some(items: list[str], limit: int = 8) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def resolve_device(name: str) -> torch.device:
    """The torch device for --device, checked at start: a missing or out-of-range GPU fails here, with the reason."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
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
    if device.index is None:
        # Always an index: torch.cuda.set_device refuses a bare "cuda" (torch 2.11 raises ValueError), and
        # tensors report cuda:N, so comparisons with them hold.
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= count:
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


def dtype_bytes(safetensors_dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (F32, BF16, ...), for the progress bar."""
    digits = "".join(c for c in safetensors_dtype if c.isdigit())
    return int(digits) // 8 if digits else 1
