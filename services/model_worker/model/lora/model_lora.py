"""A model's adapter slots: attached to its target linear layers, written per adapter, and the step's row groups."""
from __future__ import annotations

from collections.abc import Callable

import torch

from services.model_worker.model.lora.batch import LoraBatch
from services.model_worker.model.lora.peft_folder import PeftAdapter
from services.model_worker.model.lora.slots import LoraSlots, LoraState


def _layer_parts(decoder_layer) -> list[tuple[object, list[tuple[str, slice]], bool]]:
    """Each target linear layer of a decoder layer, with the projections it holds, where their outputs sit on this
    rank, and whether it is row-parallel (its inputs split across ranks)."""
    attn, mlp = decoder_layer.self_attn, decoder_layer.mlp
    qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
    return [(qkv, [(name, qkv.shard_slice(shard)) for name, shard in (("q_proj", "q"), ("k_proj", "k"),
                                                                      ("v_proj", "v"))], False),
            (attn.o_proj, [("o_proj", slice(0, attn.o_proj.out_features))], True),
            (gate_up, [("gate_proj", gate_up.shard_slice(0)), ("up_proj", gate_up.shard_slice(1))], False),
            (mlp.down_proj, [("down_proj", slice(0, mlp.down_proj.out_features))], True)]


class LoraModel:
    """Slots for max_loras adapters of rank up to max_rank in every target layer, allocated once, here."""

    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.state = LoraState(max_loras, max_rank)
        self.device = device
        self.layers: list[list[LoraSlots]] = []
        for decoder_layer in model.model.layers:
            if not hasattr(decoder_layer.mlp, "gate_up_proj"):
                raise ValueError("LoRA adapters need dense MLP layers; this model has experts")
            slots = []
            for linear, parts, split_input in _layer_parts(decoder_layer):
                linear.lora = LoraSlots(linear, parts, self.state, dtype, device, split_input)
                slots.append(linear.lora)
            self.layers.append(slots)
        # The layers and the fused decode loop (model/fused_decode.py) read the step's rows from here.
        model.model.lora = self.state
        # Tensor parallelism, rank 0: tells the other ranks each slot's change (slot, folder or None), so they
        # read the same folder into their shards of the same slot.
        self.send_change: Callable[[int, str | None], None] | None = None

    def write(self, slot: int, adapter: PeftAdapter) -> None:
        for index, slots in enumerate(self.layers):
            for layer in slots:
                layer.write(slot, index, adapter)
        self.state.ranks[slot] = adapter.rank
        if self.send_change is not None:
            self.send_change(slot, adapter.path)

    def clear(self, slot: int) -> None:
        for slots in self.layers:
            for layer in slots:
                layer.clear(slot)
        self.state.ranks[slot] = 0
        if self.send_change is not None:
            self.send_change(slot, None)

    def begin_step(self, row_slots: torch.Tensor | None) -> None:
        """The step's rows grouped by adapter (row_slots (T,) int64 on the host, -1 for the base); None: none."""
        batch = LoraBatch.build(row_slots, self.state.ranks) if row_slots is not None else None
        self.state.batch = batch.to(self.device) if batch is not None and self.device.type != "cpu" else batch

    def end_step(self) -> None:
        self.state.batch = None
