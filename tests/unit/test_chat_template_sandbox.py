"""Chat templates come from model files: they render sandboxed, and a hostile one fails as a 400-able error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from phasesplit.runtime.model.tokenizer import TextTokenizer

# Walks from a string to object's subclasses: the first step of every jinja2 template escape.
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() | length }}"
CHAT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def _tokenizer(tmp_path: Path, template: str) -> TextTokenizer:
    Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return TextTokenizer(tmp_path)


def test_template_escape_is_refused(tmp_path):
    tok = _tokenizer(tmp_path, ESCAPE)
    with pytest.raises(ValueError, match="cannot render"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_ordinary_template_still_renders_and_raises(tmp_path):
    tok = _tokenizer(tmp_path, CHAT)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    with pytest.raises(ValueError, match="bad role wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])
