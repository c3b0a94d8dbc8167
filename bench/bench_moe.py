"""Qwen3 mixture of experts on CPU, ours and transformers side by side: decode speed, bytes a token reads, batching.

A random bf16 checkpoint with a slice of Qwen3-30B-A3B's shape (128 experts, top 8, hidden 2048,
expert size 768, 32 query and 4 KV heads of 128, the real 151,936-token vocabulary, untied head;
4 layers by default), written once as safetensors (one shard a layer). transformers'
Qwen3MoeForCausalLM is built over our engine's own weight tensors (the same memory, no second copy:
its fused expert tensors have our layout), then in rounds, alternating:
  - single stream: a greedy decode of --new-tokens after a --prompt-token prompt, ours (LLMEngine)
    and transformers' generate; decode tok/s counts the tokens after the first;
  - batch: 16 streams decoding together against 1 (ours), per decode step.
Bytes a decode token reads, two ways:
  - touched: the weights handed to the kernels in the step (attention, router, norms, the experts
    the router chose in that step, recorded by a hook, the LM head and one embedding row), against
    the ideal: attention's plus the chosen experts' bytes (plus the head's, shown apart);
  - timed: the step's time times the streaming read speed measured in the same round (a sum over
    a 512 MB buffer), i.e. what the step costs in bytes at memory speed.
Medians with min-max; the ratios are medians of per-round ratios. The last line is one JSON object.

    python -m bench.bench_moe                                    # the full 4-layer slice: ~6.5 GB of RAM
    python -m bench.bench_moe --layers 1 --experts 64 --rounds 3 # what fits a shared 2-CPU machine
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from bench.bench_engine import cpu_name, run_ours, run_transformers  # noqa: E402
from services.model_worker.config.engine import EngineConfig, SchedulerLimits  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import LLMEngine  # noqa: E402
from services.model_worker.model.layers.fused_moe import FusedMoE  # noqa: E402

TARGETS = {"decode_vs_transformers": 3.0, "timed_bytes_vs_ideal": 1.5, "step16_vs_step1": 3.0}
VOCAB = 151936


def config_json(args: argparse.Namespace) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB,
        "hidden_size": args.hidden, "intermediate_size": 6144, "moe_intermediate_size": args.expert_size,
        "num_hidden_layers": args.layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": args.experts, "num_experts_per_tok": args.top_k, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "attention_bias": False, "hidden_act": "silu",
    }


def ensure_checkpoint(path: pathlib.Path, args: argparse.Namespace) -> pathlib.Path:
    """Random bf16 weights, one safetensors shard per layer, so no more than a layer is ever held twice."""
    config = config_json(args)
    if (path / "config.json").exists() and json.loads((path / "config.json").read_text()) == config:
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    hidden, size, experts = args.hidden, args.expert_size, args.experts

    def rand(*shape, scale=None):
        return (torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)).to(torch.bfloat16)

    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, path / name)
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(VOCAB, hidden, scale=1.0),
                                "lm_head.weight": rand(VOCAB, hidden), "model.norm.weight": torch.ones(hidden).bfloat16()})
    for i in range(args.layers):
        p = f"model.layers.{i}"
        tensors = {f"{p}.self_attn.q_proj.weight": rand(4096, hidden), f"{p}.self_attn.k_proj.weight": rand(512, hidden),
                   f"{p}.self_attn.v_proj.weight": rand(512, hidden), f"{p}.self_attn.o_proj.weight": rand(hidden, 4096),
                   f"{p}.self_attn.q_norm.weight": torch.ones(128).bfloat16(),
                   f"{p}.self_attn.k_norm.weight": torch.ones(128).bfloat16(),
                   f"{p}.input_layernorm.weight": torch.ones(hidden).bfloat16(),
                   f"{p}.post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
                   f"{p}.mlp.gate.weight": rand(experts, hidden, scale=1.0)}
        for e in range(experts):
            tensors[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rand(size, hidden)
            tensors[f"{p}.mlp.experts.{e}.up_proj.weight"] = rand(size, hidden)
            tensors[f"{p}.mlp.experts.{e}.down_proj.weight"] = rand(hidden, size)
        shard(f"layer-{i}.safetensors", tensors)
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


def transformers_over(engine: LLMEngine, checkpoint: pathlib.Path):
    """transformers' Qwen3MoeForCausalLM whose parameters are views of our engine's tensors (no copy)."""
    from transformers import AutoConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    ours = engine.model

    def put(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)

    put(model.model.embed_tokens, "weight", ours.model.embed_tokens.weight)
    put(model.model.norm, "weight", ours.model.norm.weight)
    put(model.lm_head, "weight", ours.lm_head.weight)
    for theirs, mine in zip(model.model.layers, ours.model.layers):
        attn, qkv = theirs.self_attn, mine.self_attn.qkv_proj.weight
        q_size, kv_size = mine.self_attn.q_size, mine.self_attn.kv_size
        put(attn.q_proj, "weight", qkv[:q_size])
        put(attn.k_proj, "weight", qkv[q_size:q_size + kv_size])
        put(attn.v_proj, "weight", qkv[q_size + kv_size:])
        put(attn.o_proj, "weight", mine.self_attn.o_proj.weight)
        put(attn.q_norm, "weight", mine.self_attn.q_norm.weight)
        put(attn.k_norm, "weight", mine.self_attn.k_norm.weight)
        put(theirs.input_layernorm, "weight", mine.input_layernorm.weight)
        put(theirs.post_attention_layernorm, "weight", mine.post_attention_layernorm.weight)
        put(theirs.mlp.gate, "weight", mine.mlp.gate.weight)
        put(theirs.mlp.experts, "gate_up_proj", mine.mlp.experts.w13)
        put(theirs.mlp.experts, "down_proj", mine.mlp.experts.w2)
    model.model.rotary_emb = Qwen3MoeRotaryEmbedding(config)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"not shared: {left[:5]}"
    return model.eval()


class ExpertRecorder:
    """Which experts each MoE layer's kernel was handed in each decode step (one row)."""

    def __init__(self, model: nn.Module):
        self.chosen: list[int] = []  # experts per layer call, decode rows only
        self.handles = [m.register_forward_hook(self.hook) for m in model.modules() if isinstance(m, FusedMoE)]

    def hook(self, module: FusedMoE, inputs, output) -> None:
        x, logits = inputs
        if x.shape[0] == 1:
            self.chosen.append(int(torch.topk(logits, module.top_k, dim=-1).indices.unique().numel()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def weight_bytes(engine: LLMEngine, args: argparse.Namespace) -> dict:
    """Bytes of the weights a single-sequence decode step needs, part by part."""
    model = engine.model
    layer = model.model.layers[0]
    attention = sum(p.numel() * p.element_size() for p in layer.self_attn.parameters())
    expert = 3 * args.hidden * args.expert_size * 2
    router = layer.mlp.gate.weight.numel() * 2
    head = model.lm_head.weight.numel() * 2
    return dict(attention=attention, expert=expert, router=router, head=head, embed_row=args.hidden * 2,
                norms=2 * args.hidden * 2)


def stream_bandwidth(buffer: torch.Tensor) -> float:
    """Bytes a second a plain read of the buffer runs at here and now (a sum: one pass, little compute)."""
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start)


def logits_difference(engine: LLMEngine, reference, prompt: list[int]) -> float:
    """Largest |ours - transformers| over the prompt's logits: both models compute the same function."""
    from services.model_worker.executor.step_inputs import StepInputs

    blocks = -(-len(prompt) // engine.kv_cache.block_size)
    host = StepInputs.build([prompt], [list(range(blocks))], [len(prompt)], engine.kv_cache.block_size)
    host.sample_rows = torch.arange(len(prompt))
    with torch.inference_mode():
        ours = engine.model.compute_logits(engine.runner.forward(host)).float()
        theirs = reference(torch.tensor([prompt])).logits[0].float()
    return (ours - theirs).abs().max().item()


def decode_step_ms(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Median milliseconds of the pure decode steps of these sequences together (after all are prefilled)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"step-{i}-{time.monotonic_ns()}", prompt, params)
    first, times = 0, []
    while engine.has_work():
        start = time.perf_counter()
        outs = engine.step()
        if first >= len(prompts) and len(outs) == len(prompts):
            times.append(time.perf_counter() - start)
        first += len(outs)
    return statistics.median(times) * 1e3


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", type=pathlib.Path, default=None,
                        help="where the random checkpoint is cached (default .cache/moe-30b-a3b-slice-...)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    path = args.checkpoint or ROOT / ".cache" / f"moe-30b-a3b-slice-{args.layers}l-{args.experts}e"
    ensure_checkpoint(path, args)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64, block_size=16,
                                          limits=SchedulerLimits(max_num_seqs=16, max_num_batched_tokens=1024)))
    reference = transformers_over(engine, path)
    sizes = weight_bytes(engine, args)
    buffer = torch.ones(256 << 20, dtype=torch.bfloat16)  # 512 MB
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (args.prompt,), generator=g).tolist() for _ in range(16)]
    rows: dict[str, list[float]] = {k: [] for k in ("ours_tps", "hf_tps", "ratio", "touched", "ideal", "timed",
                                                    "timed_ratio", "touched_ratio", "step1", "step16", "step_ratio",
                                                    "bandwidth")}
    agree = []
    logit_gap = logits_difference(engine, reference, prompts[0])
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads; {args.layers} layers, {args.experts} experts, top "
          f"{args.top_k}, hidden {args.hidden}, expert size {args.expert_size}, vocab {VOCAB}, bf16; "
          f"experts kernel: {engine.model.model.layers[0].mlp.experts.kernel.name}")
    run_ours(engine, prompts[0][:8], 2)  # warm-up: kernels built, first-touch of buffers
    for r in range(args.rounds):
        recorder = ExpertRecorder(engine.model)
        ours = run_ours(engine, prompts[0], args.new_tokens)
        recorder.close()
        theirs = run_transformers(reference, prompts[0], args.new_tokens)
        agree.append(sum(1 for a, b in zip(ours.tokens, theirs.tokens) if a == b))
        bandwidth = stream_bandwidth(buffer)
        layers_ideal = args.layers * sizes["attention"] + sum(recorder.chosen) / max(len(recorder.chosen), 1) \
            * args.layers * sizes["expert"]
        touched = layers_ideal + args.layers * (sizes["router"] + sizes["norms"]) + sizes["head"] + sizes["embed_row"]
        ideal_with_head = layers_ideal + sizes["head"]
        timed = ours.time_per_token * bandwidth
        one = decode_step_ms(engine, prompts[:1], args.new_tokens)
        many = decode_step_ms(engine, prompts, args.new_tokens)
        rows["ours_tps"].append(ours.decode_tps)
        rows["hf_tps"].append(theirs.decode_tps)
        rows["ratio"].append(ours.decode_tps / theirs.decode_tps)
        rows["ideal"].append(ideal_with_head / 1e6)
        rows["touched"].append(touched / 1e6)
        rows["touched_ratio"].append(touched / ideal_with_head)
        rows["timed"].append(timed / 1e6)
        rows["timed_ratio"].append(timed / ideal_with_head)
        rows["bandwidth"].append(bandwidth / 1e9)
        rows["step1"].append(one)
        rows["step16"].append(many)
        rows["step_ratio"].append(many / one)
        print(f"round {r + 1}: ours {ours.decode_tps:.2f} tok/s, transformers {theirs.decode_tps:.2f} tok/s "
              f"({ours.decode_tps / theirs.decode_tps:.2f}x); experts chosen per layer "
              f"{statistics.mean(recorder.chosen):.1f}; read {bandwidth / 1e9:.1f} GB/s; "
              f"timed {timed / 1e6:.0f} MB vs ideal {ideal_with_head / 1e6:.0f} MB; 16 streams / 1: "
              f"{many / one:.2f} per step", flush=True)
    print(f"single-stream decode tok/s: ours {summary(rows['ours_tps'])}, transformers {summary(rows['hf_tps'])}, "
          f"ratio {summary(rows['ratio'])} (target >= {TARGETS['decode_vs_transformers']})")
    print(f"bytes per decode token (MB): ideal (attention + chosen experts + LM head) {summary(rows['ideal'])}; "
          f"touched {summary(rows['touched'])} ({summary(rows['touched_ratio'])}x); timed at "
          f"{summary(rows['bandwidth'])} GB/s {summary(rows['timed'])} ({summary(rows['timed_ratio'])}x, target <= "
          f"{TARGETS['timed_bytes_vs_ideal']}); the LM head alone is {sizes['head'] / 1e6:.0f} MB")
    print(f"per decode step (ms, all sequences decoding): 1 stream {summary(rows['step1'])}, 16 streams "
          f"{summary(rows['step16'])}, ratio {summary(rows['step_ratio'])} (target <= {TARGETS['step16_vs_step1']})")
    print(f"the same weights in transformers: prompt logits differ by at most {logit_gap:.3g} (both bf16); "
          f"greedy tokens equal to transformers' (of {args.new_tokens}, each round): {agree}")
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "agree": agree, "logit_gap": logit_gap,
                      **{k: statistics.median(v) for k, v in rows.items()}}))
    engine.close()


if __name__ == "__main__":
    main()
