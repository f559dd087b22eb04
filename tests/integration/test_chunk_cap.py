"""The chunk cap (EngineConfig.chunk_overhead, the server's --chunk-overhead): every step's prompt
tokens stay within the efficient chunk of the engine's own measured prompt-step cost, and the
tokens come out as with chunks that fill the whole token budget."""

from phasesplit.runtime.engine.engine import EngineConfig, EngineObserver, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.engine.scheduler import ScheduledBatch
from phasesplit.runtime.request import SamplingParams


class Steps(EngineObserver):
    def __init__(self) -> None:
        self.prompt_tokens: list[int] = []

    def on_step(self, batch: ScheduledBatch, seconds: float) -> None:
        self.prompt_tokens.append(sum(n for _, n in batch.prefill))


def _engine(overhead: float | None) -> LLMEngine:
    return LLMEngine("smollm2", EngineConfig(runner=RunnerConfig(kv_cache_memory=64 << 20), max_num_batched_tokens=512,
                                             chunk_overhead=overhead))


def test_prompt_chunks_follow_the_measured_step_cost_and_keep_the_tokens() -> None:
    # A 25 % fixed-cost share, not the server's 5 %: a chunk of ~3x base/per-token binds below
    # the 512-token budget on every CPU this runs on (AVX2 fp32 and AVX512 bf16 alike).
    capped = _engine(0.25)
    tok = capped.tokenizer
    text = ("The history of the printing press begins with movable type in East Asia and continues in "
            "fifteenth-century Mainz, where metal type, oil-based ink and the screw press came together. ")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for n in (1, 4):  # prompt steps of two sizes: the fit separates the step's fixed cost from its tokens
        capped.generate([tok.encode(f"{n}: " + text * n)], params)
    caps: list[int | None] = []
    chunk_tokens = capped.chunk_tokens

    def recorded() -> int | None:
        caps.append(chunk_tokens())
        return caps[-1]

    capped.chunk_tokens = recorded  # type: ignore[method-assign]
    steps = capped.observer = Steps()
    prompt = tok.encode(text * 12 + "Summarise this in one sentence:")
    assert 400 < len(prompt) < 512, len(prompt)
    got = capped.generate([prompt], params)[0]
    prefill = [(n, cap) for n, cap in zip(steps.prompt_tokens, caps, strict=True) if n]
    assert all(cap is not None and n <= cap for n, cap in prefill), prefill
    assert len(prefill) >= 2, f"the prompt fit one step's cap: {prefill}"  # uncapped it takes one step
    assert got == _engine(None).generate([prompt], params)[0]
