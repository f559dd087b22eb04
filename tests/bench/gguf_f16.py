"""Write an F16 copy of a quantized GGUF file (same metadata, dequantized weights).

The serving comparison runs llama.cpp on F16 weights: its AMX path crashes on this machine for
Q4_1 batches, and 16-bit weights match the precision phasesplit and vLLM serve in. Norm
weights and other F32 tensors stay F32, as llama.cpp's own converter leaves them.

Usage: python tests/bench/gguf_f16.py SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

# Written by GGUFWriter itself, or describing the source's quantization.
_SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}


def convert(src: Path, dst: Path) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, f in reader.fields.items():
        if key in _SKIP:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = np.asarray(t.data)
        else:
            data = dequantize(t.data, t.tensor_type).astype(np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    tmp = dst.with_name(dst.name + ".tmp")
    convert(src, tmp)
    tmp.replace(dst)
    print(dst)
