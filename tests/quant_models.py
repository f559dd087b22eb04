"""A Q8_0 copy of the bundled Q4_1 model, for the quantized-weight tests and benchmark.

Made the cheap way: every Q4_1 tensor dequantized and re-quantized to Q8_0 with the gguf
package (the token embedding is Q8_0 already and is copied as is; F32 norms stay F32), metadata
copied. Cached under ~/.cache/phasesplit/models/ keyed by the source file's hash, so it is
written once (~10 s).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# Written by GGUFWriter itself, or describing the source's quantization.
_SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}


def q8_0_copy(src: Path | None = None) -> Path:
    """The Q8_0 copy of `src` (default: the bundled model), written on first use."""
    from phasesplit.runtime.model.files import builtin_gguf, cache_root, file_key

    src = src or builtin_gguf("smollm2")
    dst = cache_root() / "models" / f"{file_key(src)}-q8_0.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    try:
        _write_q8_0(src, tmp)
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def _write_q8_0(src: Path, dst: Path) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key in _SKIP:
            continue
        vtype = f.types[0]
        writer.add_key_value(key, f.contents(), vtype, f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        if t.tensor_type in (T.F32, T.F16, T.Q8_0):
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        else:
            blocks = quantize(dequantize(t.data, t.tensor_type).astype(np.float32), T.Q8_0)
            writer.add_tensor(t.name, blocks, raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
