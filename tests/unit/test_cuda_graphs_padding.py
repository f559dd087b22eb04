"""The padding CUDA-graph decode steps use (cuda_graphs.pad_decode), checked on CPU: a padded
batch gives the unpadded batch's logits and K/V writes; padding rows touch only the pad slot."""

import torch

from phasesplit.runtime.engine.cuda_graphs import batch_bucket, pad_decode, width_bucket
from phasesplit.runtime.model.attention import AttentionMetadata, build_metadata
from phasesplit.runtime.model.config import ModelConfig
from phasesplit.runtime.model.llama import LlamaModel, rope_inv_freq


def _model() -> LlamaModel:
    cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position=512)
    model = LlamaModel(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.2)
    model.inv_freq = rope_inv_freq(cfg)
    return model.eval()


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert batch_bucket(65) is None
    assert [width_bucket(w, 8192) for w in (1, 256, 257, 3000)] == [256, 256, 512, 4096]
    assert width_bucket(700, 640) == 700  # never narrower than the context


@torch.inference_mode()
def test_padded_decode_equals_unpadded() -> None:
    model, bs = _model(), 4
    slots = 20 * bs
    pad_slot = slots - bs  # the last block: never in a table below
    cache = torch.zeros(2, 2, slots, 2, 16)
    tables = [[3, 7, 1], [0, 5], [9, 2, 4]]
    lens = [9, 6, 11]  # context incl. the token decoded now
    g = torch.Generator().manual_seed(1)
    for table, n in zip(tables, lens, strict=True):  # the history, by a prefill
        ids = torch.randint(0, 50, (n - 1,), generator=g)
        meta = build_metadata([], [(table, 0, n - 1)], bs, torch.device("cpu"))
        model(ids, torch.arange(n - 1), cache, meta, torch.tensor([n - 2]))
    new_ids = [7, 11, 42]
    decode = list(zip(tables, lens, strict=True))
    eager_cache = cache.clone()
    meta = build_metadata(decode, [], bs, torch.device("cpu"))
    want = model(torch.tensor(new_ids), torch.tensor([n - 1 for n in lens]), eager_cache, meta, torch.arange(3))

    p = pad_decode(decode, new_ids, 4, 32, bs, pad_slot)
    padded_cache = cache.clone()
    pmeta = AttentionMetadata(slot_mapping=torch.from_numpy(p.slots), num_decode=4,
                              decode_gather=torch.from_numpy(p.gather), decode_bias=torch.from_numpy(p.bias),
                              block_size=bs)
    got = model(torch.from_numpy(p.ids), torch.from_numpy(p.positions), padded_cache, pmeta, torch.arange(4))
    torch.testing.assert_close(got[:3], want)
    assert torch.isfinite(got).all(), "padding rows stay finite"
    # the real rows wrote the same K/V (up to the matmul's rounding at another row count); the
    # padding row wrote only the pad slot
    mask = torch.ones(slots, dtype=torch.bool)
    mask[pad_slot] = False
    torch.testing.assert_close(padded_cache[:, :, mask], eager_cache[:, :, mask])
    assert torch.equal(padded_cache[:, :, mask] != 0, eager_cache[:, :, mask] != 0)
    assert not torch.equal(padded_cache[:, :, pad_slot], cache[:, :, pad_slot])
