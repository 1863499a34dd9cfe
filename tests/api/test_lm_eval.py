"""lm-evaluation-harness, the standard way to score a served model, against a real worker: its `local-completions`
model (token-id prompts in batches, `echo`, `logprobs`, `max_tokens` 1) runs a small multiple-choice task of the
repository's (tests/api/lm_eval_task/) on the shipped `tiny` model; the same task through lm-eval's own `hf`
model (transformers, in process, on the same checkpoint) is the reference: every choice's loglikelihood equal
within float tolerance, and the same accuracy. Its `local-chat-completions` model runs a generate-until task over
the chat API. Offline: the task's data are local files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.llm.test_tiny_model import hf_tiny

pytestmark = pytest.mark.integration
lm_eval = pytest.importorskip("lm_eval")  # the dev extra installs it; a bare install skips, named

TASK_DIR = Path(__file__).parent / "lm_eval_task"


@pytest.fixture(scope="module")
def worker(tiny_worker):
    return tiny_worker


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The task with its data file's absolute path (datasets resolves relative ones against the working dir)."""
    d = tmp_path_factory.mktemp("task")
    data = d / "pydocs_choice.jsonl"
    data.write_text((TASK_DIR / "pydocs_choice.jsonl").read_text())
    for name in ("pydocs_choice", "pydocs_gen"):
        yaml = (TASK_DIR / f"{name}.yaml").read_text().replace("test: pydocs_choice.jsonl", f"test: {data}")
        (d / f"{name}.yaml").write_text(yaml)
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The shipped checkpoint under transformers' converted config (what lm-eval's hf model loads)."""
    d = tmp_path_factory.mktemp("hf")
    hf_tiny(d)  # writes d / "tiny-converted" and checks that transformers loads it
    return d / "tiny-converted"


def _run(model: str, model_args: dict, task_dir: Path, task: str = "pydocs_choice", **kw) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=kw.pop("batch_size", 4),
        **kw,
    )


def _loglikelihoods(out: dict) -> list[float]:
    return [float(r[0][0]) for s in out["samples"]["pydocs_choice"] for r in s["resps"]]


def test_local_completions_scores_like_lm_evals_own_transformers_model(worker, task, hf_dir):
    served = _run(
        "local-completions",
        {
            "base_url": f"http://{worker.http_address}/v1/completions",
            "model": "tiny",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(hf_dir),
            "num_concurrent": 1,
            "max_retries": 1,
            "tokenized_requests": True,
        },
        task,
    )
    reference = _run("hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"}, task)
    ours, ref = _loglikelihoods(served), _loglikelihoods(reference)
    assert len(ours) == len(ref) == 12  # 4 questions x 3 choices
    assert ours == pytest.approx(ref, abs=2e-3)
    acc = served["results"]["pydocs_choice"]["acc,none"]
    assert acc == reference["results"]["pydocs_choice"]["acc,none"]
    print(json.dumps({"acc": acc, "loglikelihoods": ours}))


def test_local_chat_completions_generate_until(worker, task):
    """lm-eval's `local-chat-completions` model on a generate-until task: each generation is the chat API's
    answer to the same message (greedy, stop at a newline, 12 tokens), and exact_match is computed from them."""
    import openai

    out = _run(
        "local-chat-completions",
        {"base_url": f"http://{worker.http_address}/v1/chat/completions", "model": "tiny", "max_retries": 1},
        task,
        "pydocs_gen",
        apply_chat_template=True,
        batch_size=1,
    )
    client = openai.OpenAI(base_url=f"http://{worker.http_address}/v1", api_key="unused", max_retries=0)
    samples = out["samples"]["pydocs_gen"]
    assert len(samples) == 4 and any(s["resps"][0][0] for s in samples)  # it generated text
    hits = 0
    for s in samples:
        got = s["resps"][0][0]
        want = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": s["doc"]["question"]}],
            max_tokens=12,
            temperature=0,
            stop=["\n"],
            seed=1234,
        )
        assert got == want.choices[0].message.content
        hits += s["filtered_resps"][0] == s["target"]
    assert out["results"]["pydocs_gen"]["exact_match,none"] == pytest.approx(hits / 4)
