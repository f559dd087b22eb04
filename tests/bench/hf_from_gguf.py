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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # from_pretrained(gguf_file=...) wants `accelerate` for models; build the model from the
    # GGUF's config instead and load the dequantized tensors (transformers maps the names and
    # undoes llama.cpp's Q/K permutation).
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied LM head has no tensor of its own in the file.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    dst.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dst)
    tok.save_pretrained(dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
    print(sys.argv[2])
