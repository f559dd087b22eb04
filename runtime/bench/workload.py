"""What the benchmark sends: request shapes (prompt and output lengths) and prompts of exact length.

Shapes come from fixed lengths, a mixed chat + long-document workload, or an Azure LLM
inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens). Prompts are built from random
whole-word tokens of the target's own tokenizer, so each prompt is exactly N tokens, distinct
from every other prompt (no accidental prefix-cache hits), and reproducible from the seed.
"""

from __future__ import annotations

import csv
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol


class WorkloadError(ValueError):
    """A workload that cannot be built (bad trace file, impossible lengths, unusable tokenizer)."""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_len: int  # tokens the server should count for the prompt (template included)
    output_len: int  # tokens to generate (max_tokens)
    kind: str = "fixed"  # fixed | chat | doc | trace: lets results be split by class
    arrival_s: float | None = None  # offset from the start, for trace replay; None: the load decides


# ---------------------------------------------------------------- shapes


def fixed_workload(num: int, input_len: int, output_len: int) -> list[RequestSpec]:
    if num < 1 or input_len < 1 or output_len < 1:
        raise WorkloadError("--num-prompts, --input-len and --output-len must be at least 1")
    return [RequestSpec(i, input_len, output_len) for i in range(num)]


@dataclass(frozen=True)
class MixedShape:
    """Short chats with an occasional long document, the case where colocated decode stalls."""

    chat_input_len: int = 128
    chat_output_len: int = 64
    doc_input_len: int = 1536
    doc_output_len: int = 32
    doc_fraction: float = 0.2
    range_ratio: float = 0.25  # each length drawn uniformly from [len*(1-r), len*(1+r)]


def _jitter(rng: random.Random, length: int, ratio: float) -> int:
    lo, hi = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    return rng.randint(lo, hi)


def mixed_workload(num: int, shape: MixedShape, seed: int) -> list[RequestSpec]:
    if num < 1:
        raise WorkloadError("--num-prompts must be at least 1")
    if not 0.0 <= shape.doc_fraction <= 1.0:
        raise WorkloadError("--doc-fraction must be within [0, 1]")
    if not 0.0 <= shape.range_ratio < 1.0:
        raise WorkloadError("--range-ratio must be within [0, 1)")
    rng = random.Random(seed)
    # The number of documents is fixed (not drawn per request) so that small runs still
    # contain the stated share of long prompts; their positions are shuffled.
    n_doc = round(num * shape.doc_fraction)
    kinds = ["doc"] * n_doc + ["chat"] * (num - n_doc)
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        if kind == "doc":
            p, o = shape.doc_input_len, shape.doc_output_len
        else:
            p, o = shape.chat_input_len, shape.chat_output_len
        out.append(RequestSpec(i, _jitter(rng, p, shape.range_ratio), _jitter(rng, o, shape.range_ratio), kind))
    return out


# ---------------------------------------------------------------- Azure trace


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # seconds since the first row
    context_tokens: int
    generated_tokens: int


_EPOCH = datetime(1970, 1, 1)
_FRACTION = re.compile(r"^(.*\.\d{6})\d+$")


def _parse_timestamp(text: str) -> float:
    """A TIMESTAMP cell as seconds: plain seconds, or a datetime (the Azure trace has 7 fraction digits)."""
    s = text.strip()
    try:
        return float(s)
    except ValueError:
        pass
    # datetime.fromisoformat on Python 3.10 accepts at most 6 fraction digits.
    m = _FRACTION.match(s)
    if m:
        s = m.group(1)
    try:
        # Naive difference from a fixed epoch: no local time zone, so no DST jumps.
        return (datetime.fromisoformat(s).replace(tzinfo=None) - _EPOCH).total_seconds()
    except ValueError:
        raise WorkloadError(f"TIMESTAMP {text!r} is neither seconds nor a datetime") from None


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRow]:
    """Rows of an Azure LLM inference trace CSV, sorted by arrival, times relative to the first."""
    reader = csv.DictReader(lines)
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if reader.fieldnames is None or not need <= {f.strip() for f in reader.fieldnames}:
        raise WorkloadError(f"{source}: expected CSV columns {sorted(need)}, got {reader.fieldnames}")
    raw = []
    for lineno, row in enumerate(reader, start=2):
        row = {k.strip(): v for k, v in row.items() if k is not None}
        try:
            t = _parse_timestamp(row["TIMESTAMP"])
            ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        except (WorkloadError, TypeError, ValueError) as e:
            raise WorkloadError(f"{source}:{lineno}: {e}") from None
        if ctx < 1 or gen < 1:
            raise WorkloadError(f"{source}:{lineno}: token counts must be positive, got {ctx}, {gen}")
        raw.append((t, ctx, gen))
    if not raw:
        raise WorkloadError(f"{source}: no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow(t - t0, c, g) for t, c, g in raw]


def read_trace(path: str | Path) -> list[TraceRow]:
    p = Path(path)
    try:
        with p.open(newline="") as f:
            return parse_trace(f, source=str(p))
    except OSError as e:
        raise WorkloadError(f"cannot read trace {p}: {e.strerror}") from None


@dataclass(frozen=True)
class TraceScaling:
    """How to fit a production trace onto a small machine."""

    start_s: float = 0.0  # skip rows before this offset
    time_scale: float = 1.0  # multiply arrival offsets (2.0: half the rate)
    token_scale: float = 1.0  # multiply both token counts
    max_input_len: int | None = None  # clip after scaling
    max_output_len: int | None = None


def trace_workload(rows: Sequence[TraceRow], num: int | None, scaling: TraceScaling) -> list[RequestSpec]:
    if scaling.time_scale <= 0 or scaling.token_scale <= 0:
        raise WorkloadError("--trace-time-scale and --trace-token-scale must be positive")
    window = [r for r in rows if r.arrival_s >= scaling.start_s]
    if num is not None:
        window = window[:num]
    if not window:
        raise WorkloadError(f"the trace has no rows at or after {scaling.start_s} s")
    t0 = window[0].arrival_s
    out = []
    for i, r in enumerate(window):
        p = max(1, round(r.context_tokens * scaling.token_scale))
        o = max(1, round(r.generated_tokens * scaling.token_scale))
        if scaling.max_input_len is not None:
            p = min(p, scaling.max_input_len)
        if scaling.max_output_len is not None:
            o = min(o, scaling.max_output_len)
        out.append(RequestSpec(i, p, o, "trace", (r.arrival_s - t0) * scaling.time_scale))
    return out


# ---------------------------------------------------------------- prompts of exact length


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def vocab_size(self) -> int: ...


class HFTokenizer:
    """A `tokenizers` tokenizer.json; no special tokens added (the server adds its own, measured)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise WorkloadError(f"cannot load tokenizer {path}: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> HFTokenizer:
        from tokenizers import Tokenizer as _Tok

        self = cls.__new__(cls)
        try:
            self._tok = _Tok.from_str(text)
        except Exception as e:
            raise WorkloadError(f"not a tokenizer.json: {e}") from None
        return self

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)


_WORD = re.compile(r" [a-z]{3,12}")


class PromptBuilder:
    """Random text that the tokenizer turns into exactly N tokens.

    It uses tokens that are one lowercase word with a leading space and that encode back to
    themselves alone: a byte-level BPE pre-tokenizer splits text at such word boundaries, so a
    string of k of them is k tokens. Every result is checked by encoding it again.
    """

    def __init__(self, tokenizer: Tokenizer, seed: int, min_words: int = 500):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        words = []
        for i in range(tokenizer.vocab_size()):
            s = tokenizer.decode([i])
            if _WORD.fullmatch(s) and tokenizer.encode(s) == [i]:
                words.append(s)
        if len(words) < min_words:
            raise WorkloadError(
                f"the tokenizer has only {len(words)} single-token ' word' pieces (need {min_words}); "
                "it is not a byte-level BPE tokenizer this builder supports"
            )
        self.words = words

    def text(self, n_tokens: int, max_fixes: int = 8) -> str:
        if n_tokens < 1:
            raise WorkloadError(f"a prompt needs at least 1 token, asked for {n_tokens}")
        words = self.rng.choices(self.words, k=n_tokens)
        text = "".join(words)
        # The word boundary argument holds for the tokenizers this targets; check it anyway and
        # trim or extend in the rare case it does not, instead of sending a wrong length.
        for _ in range(max_fixes):
            n = len(self.tok.encode(text))
            if n == n_tokens:
                return text
            if n > n_tokens:
                words = words[: len(words) - (n - n_tokens)]
            else:
                words = words + self.rng.choices(self.words, k=n_tokens - n)
            text = "".join(words)
        raise WorkloadError(f"could not build a prompt of exactly {n_tokens} tokens")
