"""Greedy tokens of two engines compared the way a change of numerics allows (quantized weights,
bf16 weights): equal, or a first divergence explained by a logit tie (the top-2 margins are
printed)."""

from __future__ import annotations

from phasesplit.runtime.engine.engine import LLMEngine
from phasesplit.runtime.request import SamplingParams


def greedy_with_top2(eng: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt: the greedy tokens and, at each, the margin between the two most likely."""
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0, logprobs=2)
    out = []
    for i, ids in enumerate(prompts):
        tokens, margins = [], []
        for o in eng.run_to_end(f"q-{i}", ids, params):
            tokens += o.new_token_ids
            margins += [lp["top"][0][1] - lp["top"][1][1] for lp in o.logprobs or []]
        out.append((tokens, margins))
    return out


def compare(name: str, ref: list[tuple[list[int], list[float]]], got: list[tuple[list[int], list[float]]],
            new_tokens: int, max_margin_move: float) -> None:
    """Equal tokens, or a first divergence explained by a logit tie: where the reference's top-2
    margin is below the largest move of a top-2 margin the native path makes at positions where
    both still agree (its precision, measured here over all prompts). Margins are printed."""
    firsts, moves = [], []
    for a, ma, b, mb in ((a, ma, b, mb) for (a, ma), (b, mb) in zip(ref, got, strict=True)):
        assert len(a) == len(b) == new_tokens
        j = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        firsts.append(j)
        moves += [abs(x - y) for x, y in zip(ma[:j], mb[:j], strict=True)]
    precision = max(moves)
    print(f"{name}: top-2 margins moved by up to {precision:.3f} nats where the paths agree "
          f"(mean {sum(moves) / len(moves):.3f}, {len(moves)} positions)")
    assert precision < max_margin_move, f"{name}: the native path moves logits by {precision:.3f}: broken"
    for i, ((a, ma), (b, mb)), j in zip(range(len(ref)), zip(ref, got, strict=True), firsts, strict=True):
        if j is None:
            print(f"{name} prompt {i}: {new_tokens} tokens equal")
            continue
        print(f"{name} prompt {i}: first divergence at token {j}: reference {a[j]} (top-2 margin {ma[j]:.4f}), "
              f"native {b[j]} (its top-2 margin {mb[j]:.4f})")
        assert ma[j] < precision, (f"{name} prompt {i} diverges at token {j} where the reference's top-2 margin is "
                                   f"{ma[j]:.3f}, above the native path's precision {precision:.3f}: not a tie")
