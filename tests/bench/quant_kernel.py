"""The GGUF block matmuls alone: the file's row layout (quant_gemm.c) against the layout packed 16
rows to a tile (quant_x16.c, AVX512-VNNI CPUs only), with a plain read of the same bytes as the
memory's bound, all in one run.

For each type (Q8_0, Q4_1) and row count (1, 4, 32: a decode step of that many sequences), one
"step" is every projection of SmolLM2-135M (30 layers of qkv, o, gate_up, down) and its LM head,
random blocks of the real shapes, through `ps_qgemm` on --threads OpenMP threads, called from
ctypes directly. The read is torch's sum over the same bytes viewed as int64, on --threads
threads. Row layout, packed and the read alternate within each repeat; each figure is the best of
--repeats, in ms per step, with GB/s of weight bytes.

Usage: ~/.cache/phasesplit/venv/bin/python tests/bench/quant_kernel.py [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49152.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,32")
    args = ap.parse_args()
    from phasesplit.runtime.kernels import build, cpu_quant

    lib = build.quant_library()
    if lib is None:
        sys.exit("the quantized CPU kernels are unavailable here (see the log)")
    packed_ok = bool(lib.ps_qx16_supported())
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"CPU {os.uname().machine}, threads {args.threads}, packed kernel {'yes' if packed_ok else 'no (no AVX512-VNNI)'}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    for qtype in (cpu_quant.Q8_0, cpu_quant.Q4_1):
        bb = cpu_quant.BLOCK_BYTES[qtype]
        # Random bytes with a sane fp16 scale in each block (0x2000 = 2^-7): the kernels' speed
        # does not depend on the values, and quantizing 135M weights would take minutes.
        rows = []
        for n, k in SHAPES:
            b = torch.randint(0, 256, (n, k // 32, bb), dtype=torch.uint8, generator=g)
            b[..., 0], b[..., 1] = 0x00, 0x20
            if qtype == cpu_quant.Q4_1:
                b[..., 2], b[..., 3] = 0x00, 0xa0  # minimum -2^-7
            rows.append(b.reshape(n, -1).contiguous())
        packed = [cpu_quant.pack_x16(b, qtype) for b in rows] if packed_ok else []
        total = sum(b.numel() for b in rows)
        flat = torch.cat([b.reshape(-1) for b in rows])
        flat = flat[: flat.numel() // 8 * 8].view(torch.int64)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, 1536, generator=g)
            out = torch.empty(m, 49152)

            def step(ws, qt, x=x, out=out, m=m):
                t0 = time.perf_counter()
                for w, (n, k) in zip(ws, SHAPES, strict=True):
                    rc = lib.ps_qgemm(x.data_ptr(), w.data_ptr(), None, out.data_ptr(), m, n, k, w.stride(0), qt,
                                      args.threads)
                    assert rc == 0, rc
                return time.perf_counter() - t0

            def read(flat=flat):
                t0 = time.perf_counter()
                flat.sum()
                return time.perf_counter() - t0

            best = {"row layout": 1e9, "packed": 1e9, "read": 1e9}
            for _ in range(args.repeats):
                best["row layout"] = min(best["row layout"], step(rows, qtype))
                if packed_ok:
                    best["packed"] = min(best["packed"], step(packed, qtype + cpu_quant.X16))
                best["read"] = min(best["read"], read())
            figs = "  ".join(f"{k} {v * 1e3:6.2f} ms ({total / v / 1e9:5.1f} GB/s)" for k, v in best.items()
                             if v < 1e9)
            ratio = f"  row/packed {best['row layout'] / best['packed']:.2f}x" if packed_ok else ""
            print(f"{cpu_quant.name(qtype)} rows {m:>2} ({total / 1e6:.0f} MB): {figs}{ratio}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
