"""lm-evaluation-harness as a client, with no patch to either side: lm-eval's `local-completions`
model against the server (the shared small engine, float32) scores a multiple-choice task on local
data (tests/lm_eval_tasks/license_cloze) with the per-item log-likelihoods and the accuracy of
lm-eval's own `hf` backend on the same weights (transformers' load of the same GGUF).

lm-eval finds the server's tokenizer endpoints (server/tokenize.py), tokenizes through them and sends
token ids, so each choice's context / continuation boundary is the one the hf backend draws with
transformers' tokenizer. Both run in this process through `simple_evaluate`, which is what the
`lm_eval` command runs (README.md gives the command); the task index holds this task alone.
"""

from __future__ import annotations

import logging
import os

from server_utils import MODEL

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
TASK = "license_cloze"
TOL = 1e-3


def evaluate(model) -> tuple[float, dict[int, list[float]]]:
    """The task's accuracy, and each document's choices' log-likelihoods by document id."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, tasks=[TASK], task_manager=TaskManager(include_path=TASKS,
                                                                               include_defaults=False),
                          log_samples=True)
    return out["results"][TASK]["acc,none"], {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
                                              for s in out["samples"][TASK]}


def test_local_completions_matches_the_hf_backend(smol_server, hf_smol, default_gguf, caplog, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.INFO, logger="lm_eval"):
        ours = LocalCompletionsAPI(base_url=f"{smol_server}/v1/completions", model=MODEL, num_concurrent=8,
                                   max_retries=1)
    assert ours.tokenizer_backend == "remote"  # it found the server's tokenizer
    acc, lls = evaluate(ours)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf))
    hf_acc, hf_lls = evaluate(HFLM(pretrained=hf_smol, tokenizer=tokenizer, batch_size=16))

    assert sorted(lls) == sorted(hf_lls) == list(range(6))
    for doc_id, ref in hf_lls.items():
        assert len(lls[doc_id]) == len(ref) == 4
        assert max(abs(a - b) for a, b in zip(lls[doc_id], ref)) < TOL, (doc_id, lls[doc_id], ref)
    assert acc == hf_acc
    assert 0 < acc < 1  # neither all right nor all wrong: the comparison says something
