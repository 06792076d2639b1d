"""lm-eval's `loglikelihood` requests against Conveyor (its `local-completions` model: /v1/completions with echo,
logprobs 1 and max_tokens 1, the prompt's log probabilities summed over the continuation) give each item the
log-likelihood transformers gives it on the same weights in float32, within 1e-3. The task is a custom YAML task
over items this test writes; lm-eval (pinned) lives in a venv of its own (tests/support/peer_venv.py), skipped
with the reason where it cannot be installed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.support.openai_fixtures import MODEL
from tests.support.peer_venv import peer_python

LM_EVAL = "lm-eval==0.4.13"
TOL = 1e-3
ITEMS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "The capital of France is", "continuation": " a large city on the Seine"},
    {"context": "Water boils at one hundred degrees", "continuation": " Celsius at sea level."},
    {"context": "One, two, three, four,", "continuation": " five"},
    {"context": "The printing press was invented by", "continuation": " Johannes Gutenberg"},
]
TASK = """task: conveyor_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


@pytest.fixture(scope="module")
def lm_eval_python():
    return peer_python("lm-eval", LM_EVAL, "lm_eval", reuse_runtime=True)


def reference(hf_reference, items: list[dict]) -> list[float]:
    """Each item's log-likelihood by transformers, its tokens split as lm-eval splits them (the continuation's
    tokens: those of context + continuation past the context's)."""
    tok, model = hf_reference.tokenizer, hf_reference.model
    out = []
    for item in items:
        ctx = tok.encode(item["context"], add_special_tokens=False)
        whole = tok.encode(item["context"] + item["continuation"], add_special_tokens=False)
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
        out.append(sum(lp[p - 1, whole[p]].item() for p in range(len(ctx), len(whole))))
    return out


def test_lm_eval_loglikelihoods_through_conveyor_equal_transformers(
    cluster, model_dir, hf_reference, lm_eval_python, tmp_path
):
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "conveyor_ll.yaml").write_text(TASK.format(data=data))
    args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={cluster.url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={model_dir}",
            "tokenized_requests=True",  # lm-eval's default: token-id prompts (tests/e2e: echo with them)
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    cmd = [str(lm_eval_python), "-m", "lm_eval", "--model", "local-completions", "--model_args", args]
    cmd += ["--tasks", "conveyor_ll", "--include_path", str(tasks), "--output_path", str(tmp_path / "out")]
    cmd += ["--log_samples", "--batch_size", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_conveyor_ll_*.jsonl") for line in f.open()]
    got = {s["doc_id"]: float(s["resps"][0][0][0]) for s in samples}  # (logged as text)
    assert sorted(got) == list(range(len(ITEMS)))
    want = reference(hf_reference, ITEMS)
    for i, w in enumerate(want):
        assert abs(got[i] - w) < TOL, (i, ITEMS[i], got[i], w)
