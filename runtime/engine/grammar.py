"""Structured outputs: grammars that constrain which tokens a request may sample next.

A request carries its constraint as a plain, serialisable spec (`SamplingParams.guided`:
`{"kind", "value", "param"}`), so the same spec travels to a prefill worker and back. Each worker
compiles it here, through llguidance (chosen over xgrammar for its CPU cost per token on this
vocabulary; see docs/api.md), into one matcher per sequence. Each step the sampler asks the
matchers of its constrained rows for a mask of allowed tokens; free rows in the same batch are
untouched. The sampled token is then fed back to the matcher.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

# What each kind's value is, for the error message (kinds come from the API layer's fields).
KINDS = {
    "json": "a JSON schema",
    "json_object": "(none: any JSON object)",
    "regex": "a regular expression",
    "choice": "a list of strings",
    "grammar": "a Lark or GBNF grammar",
}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `param` names the request field it came from."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def spec(kind: str, value: Any, param: str) -> dict[str, str]:
    """The serialisable form of a constraint (value as text: a schema is dumped as JSON)."""
    if kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}", param)
    if kind in ("json", "choice") and not isinstance(value, str):
        value = json.dumps(value)
    return {"kind": kind, "value": "" if value is None else str(value), "param": param}


def grammar_text(guided: dict[str, str]) -> str:
    """llguidance's grammar for a spec, validated without a tokenizer (the router checks requests
    with it); raises GrammarError naming the field for a bad one."""
    import llguidance

    text = _grammar_text(guided)
    if err := llguidance.LLMatcher.validate_grammar(text):
        param = guided.get("param")
        raise GrammarError(f"{param}: {err.strip()}", param)
    return text


def _grammar_text(guided: dict[str, str]) -> str:
    import llguidance

    kind, value, param = guided.get("kind", ""), guided.get("value", ""), guided.get("param")
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                 defaults={"whitespace_flexible": False})
        if kind == "json":
            schema = json.loads(value)
            if not isinstance(schema, dict):
                raise GrammarError(f"{param}: a JSON schema must be an object", param)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults={"whitespace_flexible": False})
        if kind == "regex":
            try:
                re.compile(value)
            except re.error as e:
                raise GrammarError(f"{param}: invalid regular expression: {e}", param) from None
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            choices = json.loads(value)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise GrammarError(f"{param}: must be a non-empty list of strings", param)
            return llguidance.grammar_from("choice", choices)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise GrammarError(f"{param}: {e}", param) from None
    raise GrammarError(f"unknown constraint kind {kind!r}", param)


class Grammars:
    """Compiles constraints for one tokenizer and builds the per-step token masks."""

    def __init__(self, tokenizer_json: Path, eos_ids: list[int], logits_width: int) -> None:
        import llguidance

        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), eos_token=list(eos_ids))
        self.eos = list(eos_ids)
        self.vocab = self.tokenizer.vocab_size
        self.width = logits_width
        self.words = (self.vocab + 31) // 32
        self._pool: ThreadPoolExecutor | None = None

    def matcher(self, guided: dict[str, str]) -> Any:
        """A fresh matcher for one sequence; raises GrammarError for a grammar llguidance rejects."""
        m = self._ll.LLMatcher(self.tokenizer, grammar_text(guided), log_level=0)
        if m.is_error():
            param = guided.get("param")
            raise GrammarError(f"{param}: {m.get_error()}", param)
        return m

    def allowed(self, matchers: list[Any]) -> Any:
        """[len(matchers), logits_width] bool tensor: True where the token may be sampled next."""
        import torch  # here: the router validates specs with this module and runs no model

        bits = np.zeros((len(matchers), self.words), dtype=np.int32)
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
        flags = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab]
        stuck = ~flags.any(axis=1)
        if stuck.any():  # a matcher past its end (e.g. ignore_eos after the document) allows only EOS
            flags[np.ix_(stuck, self.eos)] = 1
        if self.width > self.vocab:  # padded embedding rows are never real tokens
            flags = np.pad(flags, ((0, 0), (0, self.width - self.vocab)))
        return torch.from_numpy(flags.astype(bool))

    def allowed_async(self, matchers: list[Any]) -> Future:
        """`allowed` on the grammar thread; the caller takes `.result()` when it needs the masks."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self.allowed, matchers)

    @staticmethod
    def advance(matcher: Any, token: int) -> None:
        matcher.consume_token(token)
