"""bf16 on CPU: how a prompt is cut into prefill steps, or found in the prefix cache, does not
change the tokens. On the kernel path every row is computed the same way whatever else is in the
step (the logits are equal bit for bit); the torch path agrees on these tokens too."""

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.request import SamplingParams


def _engine(budget: int) -> LLMEngine:
    return LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(dtype="bfloat16", kv_cache_memory=64 << 20),
                                             max_num_batched_tokens=budget))


def test_chunked_and_cached_prefill_give_the_whole_prefill_tokens() -> None:
    whole = _engine(2048)
    tok = whole.tokenizer
    text = ("The history of the printing press begins with movable type in East Asia and continues in "
            "fifteenth-century Mainz, where metal type, oil-based ink and the screw press came together. ") * 10
    prompt = tok.encode(text + "Summarise this in one sentence:")
    assert 300 < len(prompt) < 2048
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = whole.generate([prompt], params)[0]

    chunked = _engine(64)  # the prompt in 64-token steps, each over the cached prefix
    assert chunked.generate([prompt], params)[0] == want

    # the second request finds all full blocks of the first's prompt in the prefix cache
    shared = _engine(2048)
    other = tok.encode(text + "List three facts from it:")
    shared.generate([other], params)
    before = shared.blocks.hits
    assert shared.generate([prompt], params)[0] == want
    assert shared.blocks.hits > before, "the shared prefix came from the cache"
