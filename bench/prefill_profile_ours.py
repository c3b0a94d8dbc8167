"""Our engine's first token by component, for bench_prefill_layers.py: timing stand-ins for the kernels of the fused
prefill (prefill_timers.c) and timers around the Python calls of a step."""
from __future__ import annotations

import ctypes
import pathlib
import time

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_decoder

TIMERS = pathlib.Path(__file__).with_name("prefill_timers.c")
FIXED = ("norms", "qk_norm_rotary", "kv_write", "attention")  # prefill_timers.c's first counters
SHAPES = 16


class _Timed:
    """Adds a callable's wall time (ms) to totals[name]; the object's other attributes pass through."""

    def __init__(self, inner, name: str, totals: dict):
        self._inner, self._name, self._totals = inner, name, totals

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._totals[self._name] += (time.perf_counter() - start) * 1e3

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _swap(owner, attr: str, name: str, totals: dict):
    """Times owner.attr (a submodule, an attribute or a method) into totals[name]; returns what undoes it."""
    modules = getattr(owner, "_modules", {})
    if attr in modules:  # nn.Module refuses a non-module under a submodule's name: swapped in its table
        inner = modules[attr]
        modules[attr] = _Timed(inner, name, totals)
        return lambda: modules.__setitem__(attr, inner)
    if attr in vars(owner):
        inner = vars(owner)[attr]
        setattr(owner, attr, _Timed(inner, name, totals))
        return lambda: setattr(owner, attr, inner)
    setattr(owner, attr, _Timed(getattr(owner, attr), name, totals))  # a method: shadowed on the instance
    return lambda: delattr(owner, attr)


class OursProfile:
    """The engine on a checkpoint, one thread; first_token() plain, profile() split by component."""

    def __init__(self, checkpoint: pathlib.Path):
        self.engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", enable_prefix_caching=False))
        self.vocab_size = self.engine.config.vocab_size
        causal = self.engine.model
        self.model = causal.model
        if self.model.fused_decode is None or not self.model.fused_decode.prompts:
            raise RuntimeError("the fused prompt path does not apply here (no VNNI weights or no decoder.c)")
        self.totals: dict[str, float] = {}
        self.timers = build.load(TIMERS, "prefill timers")
        self.plain_table = self.timed_table = None
        self.fused = self.model.fused_decode
        # Python calls of a step, each timed where the model calls it.
        self.wrapped = [(self.model, "embed_tokens", "embedding"), (self.model, "rotary_emb", "rotary_tables"),
                        (self.model, "norm", "final_norm"), (causal, "lm_head", "lm_head"),
                        (self.engine.sampler, "sample", "sampling"), (self.model, "fused_decode", "fused")]

    def first_token(self, prompt: list[int]) -> float:
        """Milliseconds from add_request to the step that returns the prompt's first token."""
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        request_id = f"prefill-{time.monotonic_ns()}"
        start = time.perf_counter()
        self.engine.add_request(request_id, prompt, params)
        while not any(o.request_id == request_id for o in self.engine.step()):
            pass
        ttft = (time.perf_counter() - start) * 1e3
        while self.engine.has_work():  # nothing should be left; drain in case
            self.engine.step()
        return ttft

    def profile(self, prompt: list[int]) -> dict:
        """The components of one fresh prompt's first token, in ms."""
        self._timed_kernels()
        self.totals = dict.fromkeys([name for _, _, name in self.wrapped], 0.0)
        restores = [_swap(owner, attr, name, self.totals) for owner, attr, name in self.wrapped]
        phases_before = dict(self.engine.phase_seconds)
        self.fused._kernels = (self.fused._kernels[0], self.timed_table)
        try:
            total = self.first_token(prompt)
        finally:
            self.fused._kernels = (self.fused._kernels[0], self.plain_table)
            for restore in reversed(restores):
                restore()
        kernels = self._take()
        t = self.totals
        phases = {k: (self.engine.phase_seconds[k] - phases_before.get(k, 0.0)) * 1e3 for k in phases_before}
        out = {"total": total, "embedding": t["embedding"], "rotary_tables": t["rotary_tables"],
               "lm_head": t["lm_head"], "sampling": t["sampling"],
               "schedule_inputs": phases.get("schedule", 0.0) + phases.get("inputs", 0.0)}
        out.update(kernels)
        out["norms"] += t["final_norm"]
        out["residual_copies"] = t["fused"] - sum(kernels.values())
        out["rest"] = total - sum(v for k, v in out.items() if k != "total")
        return out

    def _timed_kernels(self) -> None:
        """The fused loop's kernel table with the timing stand-ins in it (built once, after its first step)."""
        if self.timed_table is not None:
            return
        if self.fused._kernels is None:  # the table is built at the loop's first step
            self.first_token([0] * 8)
        backend, table = self.fused._kernels
        self.plain_table = table
        lib = self.timers
        if table.small != table.amx:
            raise RuntimeError("expected one matmul kernel (vnni_linear) at every row count")
        lib.timers_set(*(ctypes.c_void_p(getattr(table, name))
                         for name in ("small", "linear_silu", "norm", "norm_rope", "write_kv", "prefill")))
        timed = cpu_decoder.Kernels.from_buffer_copy(table)
        address = cpu_decoder.address
        timed.small = timed.amx = address(lib, "timed_linear")
        timed.linear_silu = address(lib, "timed_linear_silu")
        timed.norm, timed.norm_rope = address(lib, "timed_norm"), address(lib, "timed_norm_rope")
        timed.write_kv, timed.prefill = address(lib, "timed_write_kv"), address(lib, "timed_prefill")
        self.timed_table = timed
        self._take()

    def _take(self) -> dict:
        """The stand-ins' counters in ms (and zeroed): matmuls named by their (n, k) in the 0.6B shape's terms."""
        counters = (ctypes.c_double * (len(FIXED) + SHAPES))()
        shapes = (ctypes.c_int64 * (3 * SHAPES))()
        seen = self.timers.timers_take(counters, shapes)
        out = {name: counters[i] / 1e6 for i, name in enumerate(FIXED)}
        hidden = self.fused.shape["hidden"]
        out.update(qkv=0.0, o=0.0, gate_up=0.0, down=0.0)
        for i in range(seen):
            n, k, silu = shapes[3 * i: 3 * i + 3]
            ms = counters[len(FIXED) + i] / 1e6
            if silu or n == 2 * self.fused.shape["intermediate"]:
                out["gate_up"] += ms
            elif k == self.fused.shape["intermediate"]:
                out["down"] += ms
            elif n == hidden:
                out["o"] += ms
            else:
                out["qkv"] += ms
        return out
