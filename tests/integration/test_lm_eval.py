"""lm-evaluation-harness as an outside client: its `local-completions` model against our HTTP API scores a
multiple-choice task as its `hf` model (transformers) does on the same float32 checkpoint."""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK = "vllm_v0_mc"
TOLERANCE = 1e-3


def evaluate(model: str, model_args: str) -> dict:
    # Imported here, not at the top: `pytest -m cuda` on a GPU machine collects this file without lm-eval.
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                   task_manager=TaskManager(include_path=str(ROOT / "tests" / "lm_eval_task")),
                                   batch_size=4, device="cpu")


def per_item(results: dict) -> dict[int, list[float]]:
    """Each document's log-likelihood of every choice."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in results["samples"][TASK]}


def test_local_completions_scores_as_hf(stack, checkpoint, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = evaluate("local-completions", f"model={checkpoint.name},base_url={stack.http_url}/v1/completions,"
                    f"tokenizer={checkpoint},tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    reference = evaluate("hf", f"pretrained={checkpoint},dtype=float32")
    ours_items, reference_items = per_item(ours), per_item(reference)
    assert sorted(ours_items) == sorted(reference_items) == list(range(10))
    for doc_id, expected in reference_items.items():
        assert len(ours_items[doc_id]) == len(expected) == 4
        assert max(abs(a - b) for a, b in zip(ours_items[doc_id], expected)) <= TOLERANCE, doc_id
    assert ours["results"][TASK]["acc,none"] == reference["results"][TASK]["acc,none"]
