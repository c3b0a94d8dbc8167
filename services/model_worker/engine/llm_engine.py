"""The engine: accept requests, and advance every live sequence one step at a time."""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from dataclasses import dataclass

import torch

from rpcserver.errors import InvalidArgument
from services.model_worker.config.engine import EngineConfig, SpeculativeConfig
from services.model_worker.config.model import ConfigError, GenerationDefaults, Qwen3Config
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.distributed.parallel import check_divisible
from services.model_worker.engine.adapters import AdapterRegistry
from services.model_worker.engine.block_manager import BlockManager
from services.model_worker.engine.pooling import (
    POOLING_SAMPLING, PoolingOutput, PoolingParams, check_input, check_served, pool_rows)
from services.model_worker.engine.scheduler import Scheduler
from services.model_worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from services.model_worker.engine.speculator import Speculator
from services.model_worker.executor.executor import Executor
from services.model_worker.executor.grammar import GrammarEngine, apply_token_bitmask
from services.model_worker.executor.penalty_state import PenaltyState
from services.model_worker.executor.prompt_logprobs import score_rows
from services.model_worker.executor.sampler import SampledBatch, Sampler
from services.model_worker.executor.spec.draft import DraftProposer

log = logging.getLogger(__name__)


FINISHED = SequenceStatus.FINISHED
PHASES = ("schedule", "inputs", "model", "sampler", "outputs")


@dataclass(slots=True)
class StepOutput:
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    finish_reason: FinishReason | None
    prompt_tokens: int
    # On a request's first output when it asked for them: per prompt position, None for the first token,
    # else (its logprob, the position's top (token id, logprob) best first).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # On the last token of a step that verified proposals for the request: how many it accepted.
    spec_accepted: int | None = None


@dataclass
class _InFlight:
    """A launched step: the sequences it samples a token for, in row order, and the draws on the device."""
    seqs: list[Sequence]
    sampled: SampledBatch
    deferred: bool  # read back after the next step launches; its sequences count their tokens as pending


class LLMEngine:
    """Wires the parts: an executor that steps the model on its device (and its other tensor-parallel
    ranks), a scheduler and block manager that choose each step, and a sampler for its tokens."""

    def __init__(self, checkpoint_dir: str | pathlib.Path, config: EngineConfig | None = None):
        self.engine_config = config = config or EngineConfig()
        self.checkpoint_dir = pathlib.Path(checkpoint_dir)
        self.config = Qwen3Config.from_json(self.checkpoint_dir)
        check_divisible(self.config, config.tensor_parallel_size)
        self.generation = GenerationDefaults.from_dir(self.checkpoint_dir)
        # The offline demo checkpoint (demo/checkpoint.py) marks its config: its weights are random.
        self.is_demo_checkpoint = "vllm_v0_demo_checkpoint" in json.loads(
            (self.checkpoint_dir / "config.json").read_text())
        self.executor = executor = Executor(self.checkpoint_dir, config, self.config)
        self.device, self.dtype, self.model = executor.device, executor.dtype, executor.model
        self.kv_cache, self.runner, self.max_model_len = executor.kv_cache, executor.runner, executor.max_model_len
        self.has_lm_head = getattr(self.model, "has_lm_head", True)  # False: a bare decoder, embeddings only
        # A table row holds a whole context and the proposals a verification adds past it.
        table_width = -(-(self.max_model_len + config.speculative.num_speculative_tokens + 1) // config.block_size)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.limits.max_num_seqs, table_width)
        self.scheduler = Scheduler(self.block_manager, config.limits)
        self.adapters = AdapterRegistry(executor.lora, self.config, config.max_lora_rank,
                                        self.block_manager.forget_adapter)
        for name, path in config.lora_modules:
            try:
                self.adapters.load(name, path, set())
            except Exception as e:  # noqa: BLE001 - a bad folder at start is a bad flag
                executor.close()
                raise ConfigError(f"--lora-modules {name}={path}: {e}") from None
        self.sampler = Sampler()
        self.penalties = PenaltyState(config.limits.max_num_seqs, self.device)
        self.eos_ids = frozenset(self.generation.eos_token_ids)
        # Seconds spent in each part of step(), summed over steps, for the host-overhead benchmark
        # (bench/bench_host.py); on a GPU "model" and "sampler" are launches, and "outputs" includes waiting for
        # the device (on a CPU the work is done where it is launched).
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self._seqs: dict[str, Sequence] = {}
        self._in_flight: _InFlight | None = None  # the step launched and not yet read back
        self.pooled: list[PoolingOutput] = []  # pooling requests' outputs not yet taken (take_pooled)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self.grammar = GrammarEngine(self.checkpoint_dir, self.config.vocab_size, self.eos_ids)
        self.draft_executor: Executor | None = None
        self.speculator = (Speculator(config.speculative, self._draft_proposer(config))
                           if config.speculative.enabled else None)

    def _draft_proposer(self, config: EngineConfig) -> DraftProposer | None:
        """Method "draft": the draft checkpoint on the same device (rank 0's), its KV cache over the target's block ids."""
        if config.speculative.method != "draft":
            return None
        draft_dir = pathlib.Path(config.speculative.draft_model)
        draft_config = Qwen3Config.from_json(draft_dir)
        if draft_config.vocab_size != self.config.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({draft_config.vocab_size}) differs from the model's "
                              f"({self.config.vocab_size}); a draft must share the tokenizer")
        if draft_config.max_position_embeddings < self.max_model_len:
            raise ConfigError(f"the draft model's context ({draft_config.max_position_embeddings}) is shorter "
                              f"than the model's ({self.max_model_len}); lower max_model_len")
        # Under tensor parallelism the draft is whole on rank 0 (this process), beside that rank's share of
        # the target, as vLLM's draft_tensor_parallel_size=1: a small model's steps gain little from being
        # split, and its proposals are needed on rank 0 alone, which schedules the verification.
        self.draft_executor = Executor(draft_dir, dataclasses.replace(
            config, num_blocks=self.kv_cache.num_blocks, max_model_len=self.max_model_len, enforce_eager=True,
            tensor_parallel_size=1, speculative=SpeculativeConfig()), draft_config)
        return DraftProposer(self.draft_executor.runner, self.kv_cache.block_size)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and the grammar thread."""
        self.grammar.close()
        self.executor.close()

    # -- requests -----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    output_ids: list[int] = (), seed: int | None = None, adapter: str = "") -> Sequence:
        """Checks, compiles the grammar (if any) here and now, and queues the sequence; the engine core
        compiles on a thread of its own instead (new_sequence, then admit)."""
        seq = self.new_sequence(request_id, prompt_ids, params, output_ids, seed, adapter)
        if params.structured_output is not None:
            seq.grammar = self.grammar.matcher(params.structured_output, seq.output_ids)
        return self.admit(seq)

    def new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     output_ids: list[int] = (), seed: int | None = None, adapter: str = "") -> Sequence:
        """The request as a sequence, its grammar not compiled; InvalidArgument naming what is wrong with it.

        output_ids: the tokens a broken stream of this request already generated; the sequence computes them
        with the prompt as one prefill and goes on after them (worker.proto's GenerateRequest.output_token_ids).
        seed: the seed of its draws when params has none. adapter: the LoRA adapter's name; "": the base model."""
        check_served(self.has_lm_head, self.engine_config.runner)
        if request_id in self._seqs:
            raise InvalidArgument(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise InvalidArgument("prompt_token_ids is empty: give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidArgument(f"the prompt has {len(prompt_ids)} tokens; this worker's context is "
                                  f"{self.max_model_len} tokens, which leaves no room to generate")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidArgument(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                  f"context of {self.max_model_len} tokens; lower max_tokens to at most {room}")
        seq = Sequence(request_id, prompt_ids, params, max_tokens, self.eos_ids, output_ids, seed)
        if seq.output_ids:
            self._check_outputs(seq, room)
        self.set_adapter(seq, adapter)
        return seq

    def set_adapter(self, seq: Sequence, adapter: str) -> None:
        """Run a new sequence with the LoRA adapter of that name ("": the base model); InvalidArgument when LoRA is
        off or no adapter has that name."""
        if adapter:
            resident = self.adapters.get(adapter)
            seq.adapter, seq.lora_slot, seq.hash_root = resident.name, resident.slot, resident.hash_root

    def _check_outputs(self, seq: Sequence, room: int) -> None:
        """InvalidArgument unless the given outputs are ids a stream of this request could have generated and
        gone on after (the grammar replays them where it is compiled)."""
        outputs, vocab = seq.output_ids, self.config.vocab_size
        bad = [t for t in outputs if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"output_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if seq.params.prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs cannot be asked for with output_token_ids: they went out with "
                                  "the first token of the stream being resumed")
        if len(outputs) >= seq.max_tokens:
            limit = (f"max_tokens ({seq.max_tokens})" if seq.params.max_tokens is not None else
                     f"the room the context of {self.max_model_len} tokens leaves after the prompt ({room})")
            raise InvalidArgument(f"output_token_ids holds {len(outputs)} ids, which reaches {limit}: the request "
                                  "had ended; nothing is left to generate")
        stop = next((i for i, t in enumerate(outputs) if t in seq.stop_ids), None)
        if stop is not None:
            raise InvalidArgument(f"output_token_ids[{stop}] = {outputs[stop]} is a stop id (an eos id unless "
                                  "ignore_eos, or one of stop_token_ids): the request would have ended there")

    def admit(self, seq: Sequence) -> Sequence:
        """Queues a checked sequence (its grammar compiled and its outputs replayed, if it has one) for the next
        steps."""
        if seq.request_id in self._seqs:
            raise InvalidArgument(f"request id {seq.request_id!r} is already in use")
        if seq.adapter:
            # Its adapter may have been unloaded or evicted while its grammar compiled.
            resident = self.adapters.by_name.get(seq.adapter)
            if resident is None or resident.slot != seq.lora_slot:
                raise InvalidArgument(f"adapter {seq.adapter!r} was unloaded before the request could start")
        self.scheduler.add(seq)
        self._seqs[seq.request_id] = seq
        return seq

    def add_pooling_request(self, request_id: str, prompt_ids: list[int], pooling: PoolingParams,
                            adapter: str = "") -> Sequence:
        """Queues a prompt-only request: it runs as a prompt does, shares steps with generating sequences, and
        at its last prompt position yields a PoolingOutput (take_pooled) instead of a token, then ends."""
        return self.admit(self.new_pooling_sequence(request_id, prompt_ids, pooling, adapter))

    def new_pooling_sequence(self, request_id: str, prompt_ids: list[int], pooling: PoolingParams,
                             adapter: str = "") -> Sequence:
        """The prompt-only request as a sequence; InvalidArgument naming what is wrong with it."""
        if request_id in self._seqs:
            raise InvalidArgument(f"request id {request_id!r} is already in use")
        check_served(self.has_lm_head, self.engine_config.runner, pooling)
        check_input(prompt_ids, self.config.vocab_size, self.max_model_len)
        pooling.validate(self.config.vocab_size, self.config.hidden_size)
        seq = Sequence(request_id, prompt_ids, POOLING_SAMPLING, 1, frozenset())
        seq.pooling = pooling
        self.set_adapter(seq, adapter)
        return seq

    def take_pooled(self) -> list[PoolingOutput]:
        """The pooling outputs of the steps since the last call."""
        taken, self.pooled = self.pooled, []
        return taken

    def _end_pooled(self, seqs: list[Sequence]) -> None:
        """Pooled sequences end with the step that pooled them (accounted first, so their full blocks stay in
        the prefix cache) and give their blocks back."""
        for seq in seqs:
            seq.finish(FinishReason.LENGTH)
            self.scheduler.release(seq)
            self._seqs.pop(seq.request_id, None)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        seq.finish(FinishReason.ABORTED)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # -- stepping -----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Schedules and launches one step; returns the tokens read back by this call.

        With asynchronous scheduling the step just launched is read back by the next call, after that one has
        launched its own: the host's scheduling and input building for step N+1 overlap step N on the device,
        and step N+1 takes the ids step N sampled from the device. A sequence that ends on its token from step N
        (an eos or stop id: the host learns it one step late) has run one more row in step N+1, whose token is
        dropped here and never sent. max_tokens is known ahead, so it costs no extra row.
        """
        clock = time.perf_counter
        phases = self.phase_seconds
        outputs: list[StepOutput] = []
        start = clock()
        if self._in_flight is not None and (self.speculator is not None or self.scheduler.may_preempt()):
            # A preemption recomputes a sequence from its ids on the host, the newest included.
            outputs += self._read_back(self._in_flight)
            self._in_flight = None
            phases["outputs"] += clock() - start
            start = clock()
        if self.adapters.draining:
            self.adapters.release_drained(self._adapter_slots_in_use())
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            if self._in_flight is not None:
                outputs += self._read_back(self._in_flight)
                self._in_flight = None
            return outputs
        if batch.num_draft:
            self.speculator.fill(batch.seqs, batch.num_draft)
        scheduled = clock()
        host, seqs, prompt_spans = batch.step_inputs(self.block_manager.tables)
        if self.adapters.enabled:
            host.lora_slots = self._lora_rows(batch)
        built = clock()
        previous = self._in_flight
        previous_ids = previous.sampled.token_ids if previous is not None else None
        if batch.pooled:
            logits, hidden = self.runner.run_pooling(host, previous_ids)
            pooled, logits = pool_rows(batch.pooled, logits, hidden)
            self.pooled += pooled
        else:
            logits = self.runner.run(host, previous_ids)
        ran = clock()
        phases["schedule"] += scheduled - start
        phases["inputs"] += built - scheduled
        phases["model"] += ran - built
        if batch.num_draft:  # speculation keeps no step in flight: it proposes from the newest ids on the host
            outputs += self._verify_step(batch, seqs, prompt_spans, logits)
            self._end_pooled(batch.pooled)
            return outputs
        launched = self._sample(batch, seqs, prompt_spans, logits, previous)
        self.scheduler.account(batch)
        if batch.pooled:
            self._end_pooled(batch.pooled)
        sampled_at = clock()
        phases["sampler"] += sampled_at - ran
        self._in_flight = None
        if previous is not None:
            outputs += self._read_back(previous)
        if launched is not None:
            if launched.deferred:
                # Each sequence counts its token in flight, and where it sits in this step's sampled ids.
                for i, seq in enumerate(launched.seqs):
                    seq.num_pending += 1
                    seq.pending_row = i
                self._in_flight = launched
            else:
                outputs += self._read_back(launched)
        phases["outputs"] += clock() - sampled_at
        return outputs

    @staticmethod
    def _lora_rows(batch) -> torch.Tensor | None:
        """Each row's adapter slot (-1: the base model), rows in the batch's order; None when no row has one."""
        slots = [seq.lora_slot for seq in batch.seqs]
        if max(slots) < 0:
            return None
        return torch.tensor(slots, dtype=torch.int64).repeat_interleave(torch.tensor(batch.num_tokens))

    # -- adapters -----------------------------------------------------------------------------------

    def _adapter_slots_in_use(self) -> set[int]:
        return {seq.lora_slot for seq in self._seqs.values() if seq.lora_slot >= 0}

    def load_adapter(self, name: str, path: str) -> dict:
        """Load a PEFT folder under `name` (evicting an idle adapter when every slot is taken); its info."""
        return self.adapters.load(name, path, self._adapter_slots_in_use()).info()

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter: refused to new requests at once, its slot freed when its running requests end."""
        self.adapters.unload(name, self._adapter_slots_in_use())

    def _can_defer(self, constrained: list[int]) -> bool:
        """Whether the next step may be scheduled before this one's tokens are on the host."""
        if not self.async_scheduling or self.speculator is not None or self.executor.group is not None:
            # Proposals are made from the newest ids on the host; tensor-parallel ranks take every input id
            # from rank 0's host.
            return False
        return not constrained  # a grammar's next mask needs the token it accepts first

    def _sample(self, batch, seqs: list[Sequence], prompt_spans, logits: torch.Tensor | None,
                previous: "_InFlight | None") -> "_InFlight | None":
        """Draws the step's tokens on the device."""
        if prompt_spans:
            self._score_prompts(logits[len(seqs):], prompt_spans)
            logits = logits[:len(seqs)]
        if not seqs:
            return None
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.active]
        if constrained:  # a batch without constraints does no grammar work at all
            logits = apply_token_bitmask(logits, constrained, [seqs[i].grammar.mask() for i in constrained])
        # Penalised rows read their histories from per-slot device rows, built once and then fed this step's ids.
        in_flight = previous.sampled.token_ids if previous is not None else None
        penalties = self.penalties.rows(seqs, logits.shape[1], in_flight)
        draws = [None if s.is_greedy else s.draw_key() for s in seqs]
        sampled = self.sampler.sample(logits, [s.params for s in seqs], penalties, draws)
        if penalties is not None:
            self.penalties.record(sampled.token_ids)
        return _InFlight(seqs, sampled, self._can_defer(constrained))

    def _read_back(self, step: "_InFlight") -> list[StepOutput]:
        """A launched step's tokens on the host: appended, checked for their end, and turned into outputs."""
        sampled = step.sampled.to_host()
        outputs = []
        block_size = self.kv_cache.block_size
        token_ids, logprobs, top_logprobs = sampled.token_ids, sampled.logprobs, sampled.top_logprobs
        deferred = step.deferred
        for i, seq in enumerate(step.seqs):
            if deferred:
                seq.num_pending -= 1
            if seq.status is FINISHED:
                continue  # aborted, or ended by its token from the step before: this one is never sent
            token = token_ids[i]
            seq.append(token)
            prompt_logprobs = seq.prompt_logprobs
            if prompt_logprobs is not None:  # handed out with the first token
                seq.prompt_logprobs = None
            outputs.append(StepOutput(seq.request_id, token, logprobs[i], top_logprobs[i], seq.finish_reason,
                                      len(seq.prompt_ids), prompt_logprobs))
            if seq.status is FINISHED:
                self.scheduler.release(seq)
                self._seqs.pop(seq.request_id, None)
            elif len(seq.token_ids) % block_size == 0 and seq.num_cached_tokens >= len(seq.token_ids):
                self.block_manager.commit(seq)  # the block this token filled, computed by a step already launched
        return outputs

    def _verify_step(self, batch, seqs: list[Sequence], prompt_spans, logits: torch.Tensor) -> list[StepOutput]:
        """A step where some sequences verify proposals: each emits its accepted tokens, then one more."""
        drafts = dict(zip(map(id, batch.seqs), batch.num_draft))
        num_draft = [drafts[id(s)] for s in seqs]
        num_rows = len(seqs) + sum(num_draft)
        if prompt_spans:
            self._score_prompts(logits[num_rows:], prompt_spans)
            logits = logits[:num_rows]
        starts = [0]
        for d in num_draft:
            starts.append(starts[-1] + d + 1)
        rows, masks = [], []
        for i, seq in enumerate(seqs):
            if seq.grammar is not None and seq.grammar.active:
                # Row j is masked by the grammar's state after the first j proposals (which it accepts).
                rows += range(starts[i], starts[i + 1])
                masks += seq.grammar.masks_along(seq.draft[:num_draft[i]]) if num_draft[i] else [seq.grammar.mask()]
        if rows:
            logits = apply_token_bitmask(logits, rows, masks)
        emitted = self.speculator.sample(self.sampler, logits, seqs, num_draft)
        self.penalties.forget(seqs)  # the tokens it emits are not added to their rows: rebuilt when next needed
        outputs = []
        for seq, d, tokens in zip(seqs, num_draft, emitted):
            self.speculator.record(seq, d, len(tokens))
            for token in tokens:
                seq.append(token.token_id)
                outputs.append(StepOutput(seq.request_id, token.token_id, token.logprob, token.top_logprobs,
                                          seq.finish_reason, len(seq.prompt_ids), seq.take_prompt_logprobs()))
                if seq.is_finished:
                    break
            if d:
                outputs[-1].spec_accepted = len(tokens) - 1
            seq.draft = []
        # Computed tokens: a verifying sequence's K/V hold its accepted proposals; its newest token, as after
        # any decode, is not computed yet.
        for i, seq in enumerate(batch.seqs):
            if batch.num_draft[i]:
                batch.num_tokens[i] = len(seq) - 1 - seq.num_cached_tokens
        self.scheduler.finish_step(batch)
        for seq, d in zip(batch.seqs, batch.num_draft):
            if d and seq.block_table:
                self.block_manager.trim(seq)
        for seq in seqs:
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        return outputs

    @staticmethod
    def _score_prompts(logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> None:
        """Writes this step's prompt logprobs into their sequences, by prompt position."""
        targets, top_n = [], []
        for seq, first, count in spans:
            targets += seq.prompt_ids[first:first + count]
            top_n += [seq.params.prompt_logprobs] * count
        scored = iter(score_rows(logits, targets, top_n))
        for seq, first, count in spans:
            for position in range(first, first + count):
                seq.prompt_logprobs[position] = next(scored)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; returns each one's generated ids (for tests and benchmarks)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{i}-{id(prompts)}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._seqs for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].append(out.token_id)
        return [results[rid] for rid in ids]

    def pool(self, prompts: list[list[int]], pooling: PoolingParams) -> list[list[float]]:
        """Run prompts as pooling requests together; returns each one's values (for tests and benchmarks)."""
        ids = [f"pool-{i}-{id(prompts)}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_pooling_request(rid, prompt, pooling)
        results: dict[str, list[float]] = {}
        while any(rid in self._seqs for rid in ids):
            self.step()
            results.update((out.request_id, out.values) for out in self.take_pooled())
        return [results[rid] for rid in ids]

    def stats(self) -> dict[str, float]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.block_manager.num_used,
            "kv_blocks_free": self.block_manager.num_free,
            "prefix_cache_hit_rate": self.block_manager.hit_rate,
            "preemptions": self.scheduler.num_preemptions,
            **(self.speculator.stats() if self.speculator is not None else {}),
        }
