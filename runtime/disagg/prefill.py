"""The prefill worker's half of the remote-prefill protocol.

One PrefillCall: run the prompt here (prefill only, one sampled token), stream each layer's new
K/V to the decode worker's receiver while the next layer computes (`begin_step` hands the engine
the per-layer callback), then end the transfer with a DONE frame carrying the first token and
wait for the receiver's ACK. Any failure aborts the transfer; the decode worker, which owns the
request, learns of it from the error reply and applies its failure policy.
"""

from __future__ import annotations

import asyncio
import logging
import time

from phasesplit.runtime.disagg.messages import PrefillCall, PrefillDone
from phasesplit.runtime.engine.engine import KVConnector
from phasesplit.runtime.engine.model_runner import LayerStream, ModelRunner
from phasesplit.runtime.engine.scheduler import ScheduledBatch
from phasesplit.runtime.engine.sequence import Sequence
from phasesplit.runtime.kv.sender import KVLinks, KVSender, TransferFailed
from phasesplit.runtime.server.async_engine import AsyncEngine

log = logging.getLogger(__name__)


class _Outgoing:
    """One call's transfer: its sender and how far the prompt has been sent."""

    def __init__(self, sender: KVSender, sent_upto: int) -> None:
        self.sender, self.sent_upto = sender, sent_upto


class PrefillConnector(KVConnector):
    """Streams the K/V each step computes for requests with a transfer, layer by layer."""

    def __init__(self, runner: ModelRunner, timeout: float, secret: str, layout: str) -> None:
        self.runner, self.timeout = runner, timeout
        self.links = KVLinks(secret, layout, timeout)  # one open link per decode worker, kept between calls
        self.outgoing: dict[str, _Outgoing] = {}  # engine request id -> transfer (event loop writes)
        self._items: list[tuple[Sequence, int, int, KVSender]] = []  # this step's (seq, lo, hi, sender)

    def close(self) -> None:
        self.links.close()

    # -- engine thread --------------------------------------------------------------------------

    def begin_step(self, batch: ScheduledBatch) -> LayerStream | None:
        self._items = []
        for seq, chunk in batch.prefill:
            out = self.outgoing.get(seq.request_id)
            if out is None:
                continue
            hi = seq.num_computed + chunk  # this step computes up to here
            if hi > out.sent_upto:  # includes prefix-cache hits on the first chunk: the decoder lacks them
                self._items.append((seq, out.sent_upto, hi, out.sender))
                out.sent_upto = hi
        if not self._items:
            return None
        return LayerStream([(seq, lo, hi) for seq, lo, hi, _ in self._items], self._layer_done)

    def _layer_done(self, layer: int, kvs: list) -> None:
        # All KV heads (gathered from the tensor-parallel ranks if any): the wire carries whole
        # layers, so a decode worker of any TP size takes them (it re-slices by head).
        for (_, lo, _, sender), kv in zip(self._items, kvs, strict=True):
            sender.send_layer(layer, lo, kv)

    # -- event loop -----------------------------------------------------------------------------

    async def prefill(self, aengine: AsyncEngine, call: PrefillCall) -> PrefillDone:
        """Run one checked call to the end of its transfer. Raises TransferFailed or RuntimeError."""
        t0 = time.monotonic()
        sender = self.links.sender((call.kv_host, call.kv_port), call.transfer_id)
        rid = f"{call.request_id}/{call.transfer_id}"
        self.outgoing[rid] = _Outgoing(sender, call.skip)
        first: int | None = None
        logprobs: dict = {}  # the first token's and the prompt's, when the request asked for them
        timing: dict[str, float] = {}  # this engine's queue wait and prefill, for the decode worker's timing
        try:
            async for out in aengine.generate(rid, call.prompt_ids, call.params, prefill_only=True):
                first = out.new_token_ids[0]
                timing = out.timing or timing
                if out.logprobs:
                    logprobs["logprob"] = out.logprobs[0]
                if out.prompt_logprobs is not None:
                    logprobs["prompt_logprobs"] = out.prompt_logprobs
            assert first is not None
            sender.finish(first, timing.get("queued_s"), timing.get("prefill_s"))
            sent = await asyncio.to_thread(sender.wait, self.timeout)
        except (TransferFailed, RuntimeError) as e:
            sender.abort()
            log.warning("prefill of %s failed: %s", rid, e)
            raise
        finally:
            self.outgoing.pop(rid, None)
            if first is None:
                sender.abort()
        return PrefillDone(bytes=sent, seconds=time.monotonic() - t0, **logprobs)
