"""The sampler (greedy, temperature, top-k, top-p, seeds, token masks, logprobs); its parameters
are request.SamplingParams."""

from __future__ import annotations

import torch

from phasesplit.runtime.kernels import build, cpu_argmax
from phasesplit.runtime.request import SamplingParams


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of an n > 1 request: choice 0 keeps the request's own stream, so
    n=1 is unchanged; the others get streams of their own, as reproducible as the first."""
    if seed is None or index == 0:
        return seed
    return token_seed(seed ^ 0x5DEECE66D, -index - 1)


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded with `seed` (splitmix64).

    Deriving it from (seed, index) instead of keeping a generator per request makes a seeded
    request's tokens independent of where they are sampled: in split mode the prefill worker
    samples token 0 and the decode worker the rest, and they match the colocated run."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


class Sampler:
    """Picks one token per row of logits. A seeded request's token i is drawn with a generator
    seeded from (seed, i), so the same seed gives the same tokens whatever else is in the batch
    and whichever worker samples them."""

    def __init__(self) -> None:
        self._gen: dict[torch.device, torch.Generator] = {}

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], banned: list[list[int]],
               indices: list[int] | None = None, allowed: dict[int, torch.Tensor] | None = None) -> list[int]:
        """logits: [rows, vocab] float32, modified in place. banned[i]: token ids not allowed in row
        i (min_tokens). indices[i]: which output token of its request row i is (0 for the first);
        default 0. allowed[i]: a bool mask over the vocabulary for constrained row i (grammar)."""
        for i, ban in enumerate(banned):
            if ban:
                logits[i, ban] = float("-inf")
        if allowed:
            rows = list(allowed)
            mask = torch.stack([allowed[i] for i in rows]).to(logits.device)
            logits[rows] = logits[rows].masked_fill(~mask, float("-inf"))
        lib = build.library() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        out = (cpu_argmax.argmax(lib.ps_argmax_f32, logits) if lib else logits.argmax(dim=-1)).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                out[i] = self._sample_row(logits[i], p, indices[i] if indices is not None else 0)
        return out

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, index: int) -> int:
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = cum - sorted_p > p.top_p  # keep the smallest set whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        gen = None
        if p.seed is not None:
            gen = self._gen.get(row.device)
            if gen is None:
                gen = self._gen[row.device] = torch.Generator(device=row.device)
            gen.manual_seed(token_seed(p.seed, index))
        return int(torch.multinomial(probs, 1, generator=gen).item())


@torch.inference_mode()
def logprobs_of(logits: torch.Tensor, chosen: list[int], top: list[int]) -> list[dict]:
    """Per row: the chosen token's log-probability under the model (the raw logits: before
    temperature, bans or grammar masks, as vLLM and OpenAI report them) and the `top[i]` most
    likely tokens. Rows are {"id", "logprob", "top": [[id, logprob], ...]}."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(top, default=0)
    vals, ids = (lp.topk(k, dim=-1) if k else (None, None))
    out = []
    for i, tok in enumerate(chosen):
        pairs = list(zip(ids[i, : top[i]].tolist(), vals[i, : top[i]].tolist(), strict=True)) if top[i] else []
        out.append({"id": tok, "logprob": picked[i], "top": [list(p) for p in pairs]})
    return out
