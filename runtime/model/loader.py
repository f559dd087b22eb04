"""Find, convert and load model weights: GGUF files and Hugging Face directories.

Parsing a GGUF with the `gguf` package and dequantizing it costs seconds; start-up speed decides
how fast a pool scales up, so the first load converts the file once into a cache folder
(safetensors + config + tokenizer.json, keyed by the file's hash) that later loads mmap in well
under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from phasesplit.runtime.model.config import ModelConfig
from phasesplit.runtime.model.files import (
    ModelError,
    ModelFiles,
    cache_root,
    cached,
    check_gguf,
    file_key,
    gguf_config,
    gguf_metadata,
    locate,
    open_gguf,
    write_config_and_tokenizer,
)
from phasesplit.runtime.model.sharding import shard_state

log = logging.getLogger(__name__)


def resolve(model: str) -> ModelFiles:
    """Turn --model into a loadable folder, converting a GGUF into the cache on first use."""
    path, name = locate(model)
    if path.is_file():
        return ModelFiles(_gguf_to_cache(path), name, gguf=path)
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path}: no *.safetensors weights in the folder")
    return ModelFiles(path, name)


def _gguf_to_cache(path: Path) -> Path:
    check_gguf(path)
    key = file_key(path)
    target = cache_root() / "models" / key
    if (target / "model.safetensors").is_file():
        log.info("model %s: converted form found in %s", path.name, target)
        return target

    def convert(out: Path) -> None:
        t0 = time.perf_counter()
        log.info("converting %s into %s (once)", path, target.parent)
        convert_gguf(path, out)
        log.info("converted %s in %.1fs", path.name, time.perf_counter() - t0)

    return cached("models", key, convert)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q and K rows (for its RoPE) for rotate-half. Rows move
    whole, so it applies to dequantized rows and to rows of quantized blocks alike."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantize a Llama GGUF into HF-layout fp32 safetensors plus config and tokenizer."""
    import gguf
    from safetensors.numpy import save_file

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = gguf_config(path, meta, set(tensors))
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(arr.reshape([int(d) for d in reversed(t.shape)]), dtype=np.float32)

    weights: dict[str, np.ndarray] = {"model.embed_tokens.weight": deq("token_embd.weight"),
                                      "model.norm.weight": deq("output_norm.weight")}
    if not cfg.tie_embeddings:
        weights["lm_head.weight"] = deq("output.weight")
    for i in range(cfg.num_layers):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        weights[hf + "self_attn.q_proj.weight"] = unpermute(deq(p + "attn_q.weight"), heads)
        weights[hf + "self_attn.k_proj.weight"] = unpermute(deq(p + "attn_k.weight"), kv_heads)
        weights[hf + "self_attn.v_proj.weight"] = deq(p + "attn_v.weight")
        weights[hf + "self_attn.o_proj.weight"] = deq(p + "attn_output.weight")
        weights[hf + "mlp.gate_proj.weight"] = deq(p + "ffn_gate.weight")
        weights[hf + "mlp.up_proj.weight"] = deq(p + "ffn_up.weight")
        weights[hf + "mlp.down_proj.weight"] = deq(p + "ffn_down.weight")
        weights[hf + "input_layernorm.weight"] = deq(p + "attn_norm.weight")
        weights[hf + "post_attention_layernorm.weight"] = deq(p + "ffn_norm.weight")
    save_file(weights, str(out / "model.safetensors"))
    write_config_and_tokenizer(meta, cfg, out)


def load_weights(model: torch.nn.Module, files: ModelFiles, dtype: torch.dtype, device: torch.device) -> None:
    """Load weights in the fused layout of LlamaModel (qkv, gate_up) and the serving dtype.

    The fused, converted tensors are cached next to the model cache on first use: start-up then
    reads one file of exactly what the model needs (about 0.3 s for SmolLM2 in bf16) instead of
    concatenating and converting every layer again. A tensor-parallel rank (`model.shard`)
    keeps its slice of each weight (sharding.py).
    """
    from safetensors.torch import load_file, save_file

    fused_file = _fused_path(files, dtype)
    if fused_file.is_file():
        state = load_file(str(fused_file))
    else:
        state = {k: v.to(dtype).contiguous() for k, v in _fuse(files, model.cfg, model.lm_head is not None).items()}
        tmp = None
        try:
            fused_file.parent.mkdir(parents=True, exist_ok=True)
            # A name no other writer has: pods sharing a cache volume may all be pid 1.
            fd, tmp = tempfile.mkstemp(dir=fused_file.parent, prefix=f".{fused_file.name}-")
            os.close(fd)
            save_file(state, tmp)
            os.rename(tmp, fused_file)
        except OSError as e:  # a read-only cache only costs start-up time
            log.warning("cannot cache fused weights at %s: %s", fused_file, e)
            if tmp:
                Path(tmp).unlink(missing_ok=True)
    shard = getattr(model, "shard", None)
    if shard is not None:
        state = shard_state(state, model.cfg, shard)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)


def _fused_path(files: ModelFiles, dtype: torch.dtype) -> Path:
    h = hashlib.sha256(str(files.folder.resolve()).encode())
    for p in sorted(files.folder.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root() / "fused" / f"{h.hexdigest()[:24]}-{str(dtype).removeprefix('torch.')}.safetensors"


def _fuse(files: ModelFiles, cfg: ModelConfig, separate_head: bool) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for p in sorted(files.folder.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                state[k] = f.get_tensor(k)
    try:
        fused = {"embed.weight": state["model.embed_tokens.weight"], "norm": state["model.norm.weight"]}
        if separate_head:
            fused["lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        for i in range(cfg.num_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            a = hf + "self_attn."
            fused[me + "qkv.weight"] = torch.cat([state[a + "q_proj.weight"], state[a + "k_proj.weight"],
                                                  state[a + "v_proj.weight"]])
            fused[me + "o_proj.weight"] = state[a + "o_proj.weight"]
            fused[me + "gate_up.weight"] = torch.cat([state[hf + "mlp.gate_proj.weight"],
                                                      state[hf + "mlp.up_proj.weight"]])
            fused[me + "down.weight"] = state[hf + "mlp.down_proj.weight"]
            fused[me + "attn_norm"] = state[hf + "input_layernorm.weight"]
            fused[me + "mlp_norm"] = state[hf + "post_attention_layernorm.weight"]
    except KeyError as e:
        raise ModelError(f"{files.folder}: weight {e.args[0]} is missing") from None
    return fused
