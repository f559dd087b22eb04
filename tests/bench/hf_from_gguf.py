"""Write a Hugging Face model folder (config, bf16 safetensors, tokenizer) from a GGUF file.

vLLM serves Hugging Face folders; converting the same bundled GGUF keeps every engine in the
comparison on the same weights. Uses transformers' own GGUF loader.

Usage: python tests/bench/hf_from_gguf.py SRC.gguf DST_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path


def convert(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
    print(sys.argv[2])
