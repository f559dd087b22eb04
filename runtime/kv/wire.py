"""The KV transfer wire format: fixed binary headers, raw tensor payloads, no pickle.

Every frame is a 64-byte header followed by `payload_len` bytes:

    magic "PSKV" | version u8 | kind u8 | dtype u8 | pad u8 | transfer_id u64 | layer u32 |
    token_start u32 | num_tokens u32 | kv_heads u32 | head_dim u32 | value u32 (first token / status) |
    payload_len u64 | header_crc u32 | pad

A DATA frame carries layer `layer`'s K and V for tokens [token_start, token_start+num_tokens) as a
[2, num_tokens, kv_heads, head_dim] tensor. DONE ends a transfer and carries the first sampled
token in `value` and, in `layer` and `token_start`, the prefill worker's queue wait and prefill
compute for it (microseconds + 1; 0: not reported), so that the decode worker can tell a client
where its time to first token went; the receiver answers ACK or NACK. The header has a CRC so
that a garbled header is caught before its lengths are trusted; payload lengths are checked
against the shape.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"PSKV"
VERSION = 1
_FMT = "<4sBBBBQIIIIIIQ"
_BODY = struct.calcsize(_FMT)
HEADER_SIZE = 64
_PAD = HEADER_SIZE - _BODY - 4

DATA, DONE, ACK, NACK = 1, 2, 3, 4
KINDS = {DATA, DONE, ACK, NACK}

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
MAX_PAYLOAD = 1 << 31  # no single layer chunk is near this; a bigger claim is garbage


class FrameError(ValueError):
    """A frame that must be rejected (and its connection closed)."""


@dataclass
class Header:
    kind: int
    transfer_id: int
    layer: int = 0
    token_start: int = 0
    num_tokens: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    value: int = 0
    dtype: int = 0
    payload_len: int = 0

    def pack(self) -> bytes:
        body = struct.pack(_FMT, MAGIC, VERSION, self.kind, self.dtype, 0, self.transfer_id, self.layer,
                           self.token_start, self.num_tokens, self.kv_heads, self.head_dim, self.value,
                           self.payload_len)
        return body + struct.pack("<I", zlib.crc32(body)) + b"\0" * _PAD

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        if len(raw) != HEADER_SIZE:
            raise FrameError(f"short header ({len(raw)} of {HEADER_SIZE} bytes)")
        body = raw[:_BODY]
        (crc,) = struct.unpack_from("<I", raw, _BODY)
        magic, version, kind, dtype, _, tid, layer, start, n, heads, dim, value, plen = struct.unpack(_FMT, body)
        if magic != MAGIC:
            raise FrameError("bad magic: not a phasesplit KV frame")
        if zlib.crc32(body) != crc:
            raise FrameError("header checksum mismatch")
        if version != VERSION:
            raise FrameError(f"unsupported wire version {version}")
        if kind not in KINDS:
            raise FrameError(f"unknown frame kind {kind}")
        h = cls(kind, tid, layer, start, n, heads, dim, value, dtype, plen)
        if kind == DATA:
            if dtype not in CODE_DTYPES:
                raise FrameError(f"unknown dtype code {dtype}")
            expected = 2 * n * heads * dim * CODE_DTYPES[dtype].itemsize
            if plen != expected or plen > MAX_PAYLOAD:
                raise FrameError(f"payload length {plen} does not match shape [2,{n},{heads},{dim}] ({expected})")
        elif plen != 0:
            raise FrameError("control frames carry no payload")
        return h


def data_frame(transfer_id: int, layer: int, token_start: int, kv: torch.Tensor) -> tuple[bytes, memoryview]:
    """Header and payload for one layer's K/V ([2, tokens, kv_heads, head_dim], on CPU)."""
    kv = kv.contiguous()
    payload = memoryview(kv.view(torch.uint8).numpy()).cast("B")
    h = Header(DATA, transfer_id, layer, token_start, kv.shape[1], kv.shape[2], kv.shape[3],
               dtype=DTYPE_CODES[kv.dtype], payload_len=payload.nbytes)
    return h.pack(), payload


def payload_tensor(h: Header, payload: bytearray | memoryview) -> torch.Tensor:
    t = torch.frombuffer(payload, dtype=torch.uint8).view(CODE_DTYPES[h.dtype])
    return t.view(2, h.num_tokens, h.kv_heads, h.head_dim)


_U32 = (1 << 32) - 1


def _micros(seconds: float | None) -> int:
    return 0 if seconds is None else min(_U32, round(max(0.0, seconds) * 1e6) + 1)


def done_header(transfer_id: int, first_token: int, queued_s: float | None = None,
                compute_s: float | None = None) -> Header:
    """The DONE frame of a transfer: its first token and the prefill worker's own phase times."""
    return Header(DONE, transfer_id, layer=_micros(queued_s), token_start=_micros(compute_s), value=first_token)


def done_phases(h: Header) -> tuple[float | None, float | None]:
    """(queue wait, prefill compute) in seconds from a DONE header; None where not reported."""
    def seconds(v: int) -> float | None:
        return None if v == 0 else (v - 1) / 1e6

    return seconds(h.layer), seconds(h.token_start)
