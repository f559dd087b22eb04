"""Sampler properties and the KV wire format's rejection of bad frames."""

import pytest
import torch

from phasesplit.runtime.engine.sampling import Sampler
from phasesplit.runtime.kv.wire import (
    DATA,
    DONE,
    HEADER_SIZE,
    FrameError,
    Header,
    data_frame,
    done_header,
    done_phases,
    payload_tensor,
)
from phasesplit.runtime.request import SamplingParams


def test_greedy_top_k_top_p_and_seed():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    s = Sampler()
    assert s.sample(logits.clone(), [SamplingParams(temperature=0)], [[]]) == [1]
    # top_k=2 keeps only tokens 1 and 3, top_p small keeps only the top token
    seen = {s.sample(logits.clone(), [SamplingParams(temperature=1.0, top_k=2)], [[]])[0]
            for i in range(50)}
    assert seen <= {1, 3}
    assert {s.sample(logits.clone(), [SamplingParams(temperature=1.0, top_p=0.01)], [[]])[0]
            for i in range(20)} == {1}
    flat = torch.zeros(1, 1000)
    a = [Sampler().sample(flat.clone(), [SamplingParams(seed=7)], [[]])[0] for _ in range(3)]
    assert len(set(a)) == 1, "same seed, same token"


def test_min_tokens_bans_eos():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    assert Sampler().sample(logits, [SamplingParams(temperature=0)], [[1]]) == [2]


@pytest.mark.parametrize("bad", [
    SamplingParams(max_tokens=0), SamplingParams(temperature=-0.5), SamplingParams(top_p=0),
    SamplingParams(min_tokens=5, max_tokens=2)])
def test_invalid_params(bad):
    with pytest.raises(ValueError):
        bad.validate()


def test_frame_roundtrip():
    kv = torch.randn(2, 5, 3, 64).to(torch.bfloat16)
    head, payload = data_frame(42, 7, 16, kv)
    h = Header.unpack(head)
    assert (h.kind, h.transfer_id, h.layer, h.token_start, h.num_tokens) == (DATA, 42, 7, 16, 5)
    assert torch.equal(payload_tensor(h, bytearray(payload)), kv)


def test_done_frame_carries_the_prefill_workers_phase_times():
    h = Header.unpack(done_header(9, 1234, queued_s=0.0, compute_s=0.123456).pack())
    assert (h.kind, h.transfer_id, h.value) == (DONE, 9, 1234)
    assert done_phases(h) == (0.0, 0.123456)  # a zero wait is a time, not "not reported"
    assert done_phases(Header.unpack(done_header(9, 1).pack())) == (None, None)
    assert done_phases(Header(DONE, 9, value=1)) == (None, None)  # a sender that reports none
    far, _ = done_phases(done_header(9, 1, queued_s=1e9, compute_s=-1.0))  # clamped to the field
    assert far == pytest.approx(((1 << 32) - 2) / 1e6)


def test_bad_headers_are_rejected():
    good = Header(DONE, 1, value=5).pack()
    with pytest.raises(FrameError, match="magic"):
        Header.unpack(b"XXXX" + good[4:])
    flipped = bytearray(good)
    flipped[20] ^= 0xFF
    with pytest.raises(FrameError, match="checksum"):
        Header.unpack(bytes(flipped))
    with pytest.raises(FrameError, match="short"):
        Header.unpack(good[:HEADER_SIZE - 1])
    lying = Header(DATA, 1, num_tokens=4, kv_heads=3, head_dim=64, dtype=1, payload_len=10).pack()
    with pytest.raises(FrameError, match="payload length"):
        Header.unpack(lying)


def test_seeded_token_depends_only_on_seed_and_index():
    """Split mode samples token 0 on the prefill worker and the rest on the decode worker, each
    with its own Sampler: a seeded draw must not depend on what the sampler drew before."""
    flat = torch.zeros(1, 1000)
    p = SamplingParams(seed=7)
    fresh = [Sampler().sample(flat.clone(), [p], [[]], [i])[0] for i in range(8)]
    busy = Sampler()
    busy.sample(flat.clone(), [SamplingParams(seed=99)], [[]], [0])  # another request
    assert [busy.sample(flat.clone(), [p], [[]], [i])[0] for i in range(8)] == fresh
    assert len(set(fresh)) > 4, "successive tokens get different draws"
    other_seed = [Sampler().sample(flat.clone(), [SamplingParams(seed=8)], [[]], [i])[0] for i in range(8)]
    assert other_seed != fresh
