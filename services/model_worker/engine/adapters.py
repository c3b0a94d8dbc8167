"""The engine's LoRA adapters by name: which slot each holds, loading into a free or idle slot, unloading when idle."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from rpcserver.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.model_worker.config.model import Qwen3Config
from services.model_worker.engine.block_manager import adapter_root
from services.model_worker.model.lora.model_lora import LoraModel
from services.model_worker.model.lora.peft_folder import AdapterError, read_adapter

log = logging.getLogger(__name__)

NOT_ENABLED = "LoRA adapters are not enabled (--enable-lora)"


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    slot: int
    hash_root: bytes
    last_used: int = 0

    def info(self) -> dict:
        return {"name": self.name, "path": self.path, "rank": self.rank}


class AdapterRegistry:
    """Names to resident adapters, at most one per slot.

    Loading into a full set evicts the least recently used adapter no sequence uses (running or waiting), else
    refuses (ResourceExhausted). Unloading one in use takes its name away at once (new requests naming it are
    refused) and frees its slot once its last sequence ends (release_drained, every step): its requests finish.
    """

    def __init__(self, lora: LoraModel | None, model_config: Qwen3Config, max_rank: int,
                 forget_blocks: Callable[[bytes], None]):
        self.lora = lora
        self.model_config = model_config
        self.max_rank = max_rank
        self.forget_blocks = forget_blocks  # drops an unloaded adapter's cached prefix blocks
        self.by_name: dict[str, Adapter] = {}
        self.draining: list[Adapter] = []  # unloaded while in use: their slots wait for their sequences
        self._clock = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.lora is not None

    def get(self, name: str) -> Adapter:
        """The resident adapter requests name; InvalidArgument when LoRA is off or no adapter has that name."""
        if self.lora is None:
            raise InvalidArgument(NOT_ENABLED)
        adapter = self.by_name.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise InvalidArgument(f"unknown adapter {name!r} (loaded: {known})")
        adapter.last_used = next(self._clock)
        return adapter

    def load(self, name: str, path: str, in_use: set[int]) -> Adapter:
        """Read the folder and write it into a slot; in_use: the slots sequences use now."""
        if self.lora is None:
            raise FailedPrecondition(NOT_ENABLED)
        if not name:
            raise InvalidArgument("an adapter needs a name")
        if name in self.by_name:
            raise InvalidArgument(f"an adapter named {name!r} is already loaded; unload it first")
        if any(a.name == name for a in self.draining):
            raise InvalidArgument(f"adapter {name!r} is still unloading (its requests are running); retry when "
                                  "they end")
        try:
            peft = read_adapter(path, self.model_config, self.max_rank)
        except AdapterError as e:
            raise InvalidArgument(f"adapter {name!r}: {e}") from None
        slot = self._free_slot(in_use)
        self.lora.write(slot, peft)
        adapter = self.by_name[name] = Adapter(name, peft.path, peft.rank, slot, adapter_root(name),
                                               next(self._clock))
        log.info("adapter %s loaded from %s (rank %d) into slot %d", name, peft.path, peft.rank, slot)
        return adapter

    def unload(self, name: str, in_use: set[int]) -> None:
        if self.lora is None:
            raise FailedPrecondition(NOT_ENABLED)
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise NotFound(f"no adapter named {name!r} is loaded")
        if adapter.slot in in_use:
            log.info("adapter %s unloaded; its slot is freed when its running requests end", name)
            self.draining.append(adapter)
        else:
            self._free(adapter)

    def release_drained(self, in_use: set[int]) -> None:
        """Free the slots of unloaded adapters whose sequences have all ended."""
        for adapter in [a for a in self.draining if a.slot not in in_use]:
            self.draining.remove(adapter)
            self._free(adapter)

    def infos(self) -> list[dict]:
        return [a.info() for a in sorted(self.by_name.values(), key=lambda a: a.name)]

    def _free_slot(self, in_use: set[int]) -> int:
        taken = {a.slot for a in self.by_name.values()} | {a.slot for a in self.draining}
        free = [s for s in range(self.lora.state.max_loras) if s not in taken]
        if free:
            return free[0]
        idle = [a for a in self.by_name.values() if a.slot not in in_use]
        if not idle:
            raise ResourceExhausted(f"all {self.lora.state.max_loras} adapter slots (--max-loras) hold adapters "
                                    "with running or waiting requests; retry later or unload one")
        victim = min(idle, key=lambda a: a.last_used)
        log.info("adapter %s evicted (idle, least recently used) to make room", victim.name)
        del self.by_name[victim.name]
        self._free(victim)
        return victim.slot

    def _free(self, adapter: Adapter) -> None:
        self.lora.clear(adapter.slot)
        self.forget_blocks(adapter.hash_root)
