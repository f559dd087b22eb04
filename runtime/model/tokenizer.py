"""Tokenizer and chat template, from the model's own files (tokenizer.json + tokenizer_config.json).

GGUF files carry the vocabulary and merges in their metadata; `tokenizer_from_gguf_metadata`
rebuilds a byte-level BPE `tokenizers.Tokenizer` from them once, at conversion time.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> tuple[Tokenizer, str | None]:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    splits = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "qwen2", "llama-bpe", "deepseek-llm"):
        # These vocabularies split digits one by one before the byte-level regex.
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    return tok, meta.get("tokenizer.chat_template")


class TextTokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(self, folder: Path) -> None:
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        # Templates come from model files (GGUF metadata, tokenizer_config.json) that a user may have
        # downloaded from anywhere: render them sandboxed, as transformers does (cf. CVE-2024-34359).
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           keep_trailing_newline=False)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if template else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token is not None:
            bos = self.tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a byte-level piece may be part of a UTF-8 character)."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode()  # an added/special token is stored as its text

    def token_text(self, token_id: int) -> str:
        """One token as text, as logprobs report it (undecodable bytes shown as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise ValueError(f"the chat template cannot render these messages: {e}") from None


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_start = 0  # decode a short window so each step costs O(1), not O(length)
        self._prefix_text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        window = self.tokenizer.decode(self.ids[self._prefix_start:])
        if window.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character; wait for the next token
        delta = window[len(self._prefix_text):]
        self.text += delta
        if len(self.ids) - self._prefix_start > 8:
            self._prefix_start = len(self.ids) - 4
            self._prefix_text = self.tokenizer.decode(self.ids[self._prefix_start:])
        else:
            self._prefix_text = window
        return delta


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, inverted (GPT-2's bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_text(t: Any) -> str | None:
    if isinstance(t, dict):
        return t.get("content")
    return t


def _raise(message: str) -> None:
    raise ValueError(message)
