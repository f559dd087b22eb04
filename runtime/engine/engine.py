"""The serving engine: requests in, token streams out, one scheduled step at a time.

`LLMEngine` is synchronous and single-threaded by design (the async server drives it from one
thread). It validates requests, schedules, runs the model, samples, detokenizes, applies stop
conditions and frees blocks the moment a request ends or is aborted.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from phasesplit.runtime.engine.block_manager import BlockManager
from phasesplit.runtime.engine.model_runner import ModelRunner, RunnerConfig
from phasesplit.runtime.engine.sampling import Sampler, SamplingParams
from phasesplit.runtime.engine.scheduler import ScheduledBatch, Scheduler
from phasesplit.runtime.engine.sequence import Sequence, Status
from phasesplit.runtime.model.loader import resolve
from phasesplit.runtime.model.tokenizer import IncrementalDecoder, TextTokenizer

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request that can never be served as asked (the server maps it to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineConfig:
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # set when finish_reason is "error"
    timing: dict[str, float] | None = None  # on the last output: seconds queued, in prefill, decoding


class EngineObserver:
    """Hooks for metrics; the default does nothing so the engine has no metrics dependency."""

    def on_scheduled(self, seq: Sequence) -> None: ...
    def on_token(self, seq: Sequence, now: float) -> None: ...
    def on_finished(self, seq: Sequence, now: float) -> None: ...
    def on_step(self, batch: ScheduledBatch, seconds: float) -> None: ...


class KVExport:
    """Hooks the prefill worker uses to stream K/V out layer by layer (see server/split.py)."""

    def begin(self, batch: ScheduledBatch) -> None: ...
    def layer_done(self, layer: int) -> None: ...


class _Stream:
    """Per-request output state: incremental text and stop-string matching."""

    def __init__(self, tokenizer: TextTokenizer, stops: list[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that may start a stop string
        self.emitted = 0
        self.pending_ids: list[int] = []

    def push(self, token: int) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.decoder.push(token)
        text = self.decoder.text
        if self.stops:
            window_start = max(0, self.emitted - self.hold)
            cut = min((i for s in self.stops if (i := text.find(s, window_start)) >= 0), default=-1)
            if cut >= 0:
                out = text[self.emitted : cut]
                self.emitted = cut
                return out, True
        safe = max(self.emitted, len(text) - self.hold) if self.stops else len(text)
        out = text[self.emitted : safe]
        self.emitted = safe
        return out, False

    def flush(self) -> str:
        out = self.decoder.text[self.emitted :]
        self.emitted = len(self.decoder.text)
        return out


class LLMEngine:
    def __init__(self, model: str = "smollm2", config: EngineConfig | None = None,
                 observer: EngineObserver | None = None) -> None:
        self.config = config or EngineConfig()
        files = resolve(model)
        self.model_name = files.name
        self.tokenizer = TextTokenizer(files.folder)
        self.runner = ModelRunner(files, self.config.runner)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size, self.config.prefix_caching)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.sampler = Sampler()
        self.observer = observer or EngineObserver()
        self.eos_ids = set(self.runner.cfg.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.streams: dict[str, _Stream] = {}
        self.outputs_pending: list[RequestOutput] = []
        # Split mode, decode side: requests whose prompt a prefill worker computes.
        self.remote_waiting: list[Sequence] = []  # waiting for blocks to reserve
        self.on_reserved: Callable[[Sequence], None] | None = None
        # Called when a request's reserved blocks are about to be dropped before its K/V arrived
        # (abort, failure, local fallback): it must stop the transfer, and returns False when a
        # frame is still being received into those blocks. They are then held, not freed, until
        # `release_held(key)` says the frame has ended, so they cannot be handed to another request.
        self.on_remote_end: Callable[[Sequence, int], bool] | None = None
        self.held: dict[int, list[int]] = {}  # hold key -> blocks kept for a frame in flight
        self._hold_keys = itertools.count()
        # Split mode, prefill side.
        self.kv_export: KVExport | None = None

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestError for a request that could never complete."""
        try:
            params.validate()
        except ValueError as e:  # messages start with the offending field's name
            raise RequestError(str(e), str(e).split()[0]) from None
        if prompt_len == 0:
            raise RequestError("the prompt is empty", "prompt")
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{prompt_len} prompt tokens plus max_tokens={params.max_tokens} ({total})", "max_tokens")
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise RequestError(
                f"the request needs {total} tokens of KV cache but this worker holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}", "max_tokens")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False) -> Sequence:
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        self.check_request(len(prompt_ids), params)
        seq = Sequence(request_id, list(prompt_ids), params, prefill_only=prefill_only)
        self.seqs[request_id] = seq
        self.streams[request_id] = _Stream(self.tokenizer, params.stop)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. Returns False if it was not known."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self._finish(seq, time.monotonic())
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.outputs_pending) or bool(self.remote_waiting)

    # -- split mode, decode side ----------------------------------------------------------------

    def add_remote(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Accept a request whose prompt another worker prefills into blocks reserved here."""
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        self.check_request(len(prompt_ids), params)
        seq = Sequence(request_id, list(prompt_ids), params, status=Status.REMOTE_PREFILL)
        self.seqs[request_id] = seq
        self.streams[request_id] = _Stream(self.tokenizer, params.stop)
        self.remote_waiting.append(seq)
        self._reserve_remote()
        return seq

    def _reserve_remote(self) -> None:
        while self.remote_waiting and self.blocks.can_allocate(self.remote_waiting[0]):
            seq = self.remote_waiting.pop(0)
            self.blocks.allocate(seq)  # prefix-cache hits here need not be sent
            seq.first_scheduled = time.monotonic()
            self.observer.on_scheduled(seq)
            if self.on_reserved is not None:
                self.on_reserved(seq)

    def complete_remote(self, request_id: str, first_token: int, transfer_s: float | None = None) -> bool:
        """The prompt's K/V arrived: join the running batch with the prefill's first token."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not Status.REMOTE_PREFILL or not seq.block_table:
            return False
        seq.num_computed = len(seq.prompt_ids)
        seq.kv_transfer_s = transfer_s
        self.blocks.register_computed(seq)
        seq.status = Status.RUNNING
        self.scheduler.running.append(seq)
        self.outputs_pending.append(self._append_token(seq, first_token, time.monotonic()))
        return True

    def prefill_locally(self, request_id: str) -> bool:
        """Fall back to computing the prompt here (a failed or skipped remote prefill)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not Status.REMOTE_PREFILL:
            return False
        if seq in self.remote_waiting:
            self.remote_waiting.remove(seq)
        self._drop_remote_blocks(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.scheduler.waiting.appendleft(seq)
        return True

    def _drop_remote_blocks(self, seq: Sequence) -> None:
        """Free a remote-prefill sequence's reservation, or hold it while a frame is landing in it."""
        if seq.block_table and self.on_remote_end is not None:
            key = next(self._hold_keys)
            if not self.on_remote_end(seq, key):
                self.held[key] = seq.block_table
                seq.block_table = []
                seq.num_registered = 0
                return
        self.blocks.free_seq(seq)

    def release_held(self, key: int) -> None:
        """The frame that was landing in held blocks has ended: they may be reused now."""
        blocks = self.held.pop(key, None)
        if blocks is not None:
            self.blocks.free_blocks(blocks)

    def fail(self, request_id: str, message: str) -> None:
        """End a request with an error the client will see."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        seq.finish_reason = "error"
        self._finish(seq, time.monotonic())
        self.outputs_pending.append(RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                                  prompt_tokens=len(seq.prompt_ids),
                                                  completion_tokens=len(seq.output_ids), error=message))

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._reserve_remote()
        outputs, self.outputs_pending = self.outputs_pending, []
        batch = self.scheduler.schedule()
        if batch.empty:
            return outputs
        now = time.monotonic()
        for seq, _ in batch.prefill:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
                self.observer.on_scheduled(seq)
        after_layer = None
        if self.kv_export is not None:
            self.kv_export.begin(batch)
            after_layer = self.kv_export.layer_done
        t0 = time.perf_counter()
        sampled, logits = self.runner.run(batch, after_layer)
        for seq, _ in batch.prefill:
            self.blocks.register_computed(seq)
        banned = [self._banned(s) for s in sampled]
        tokens = self.sampler.sample(logits, [s.params for s in sampled], [s.request_id for s in sampled], banned,
                                     [len(s.output_ids) for s in sampled])
        now = time.monotonic()
        for seq, token in zip(sampled, tokens, strict=True):
            outputs.append(self._append_token(seq, token, now))
        self.observer.on_step(batch, time.perf_counter() - t0)
        return outputs

    def _banned(self, seq: Sequence) -> list[int]:
        if len(seq.output_ids) >= seq.params.min_tokens:
            return []
        return sorted(self.eos_ids | set(seq.params.stop_token_ids))

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        seq.output_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.observer.on_token(seq, now)
        seq.last_token_time = now
        p = seq.params
        text, stopped = self.streams[seq.request_id].push(token)
        reason = None
        if stopped:
            reason = "stop"
        elif token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        elif seq.prefill_only:
            reason = "prefilled"
        out = RequestOutput(seq.request_id, [token], text, prompt_tokens=len(seq.prompt_ids),
                            completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_prompt)
        if reason is not None:
            if not stopped:
                out.text += self.streams[seq.request_id].flush()
            seq.finish_reason = reason
            out.finished, out.finish_reason = True, reason
            out.timing = _timing(seq, now)
            self._finish(seq, now)
        return out

    def _finish(self, seq: Sequence, now: float) -> None:
        if seq in self.remote_waiting:
            self.remote_waiting.remove(seq)
        if seq.status is Status.REMOTE_PREFILL:
            self._drop_remote_blocks(seq)
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        self.streams.pop(seq.request_id, None)
        self.observer.on_finished(seq, now)

    # -- offline use --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); returns output ids in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        while any(rid in self.seqs for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]


def _timing(seq: Sequence, now: float) -> dict[str, float]:
    """Where the request's time went (the bench tool reads it from the last chunk)."""
    scheduled = seq.first_scheduled or seq.arrival
    first = seq.first_token_time or now
    t = {"queued_s": scheduled - seq.arrival, "prefill_s": first - scheduled, "decode_s": now - first}
    if seq.kv_transfer_s is not None:  # split: the layer-wise transfer overlaps the remote prefill
        t["kv_transfer_s"] = seq.kv_transfer_s
    return t


__all__ = ["EngineConfig", "LLMEngine", "RequestError", "RequestOutput", "SamplingParams", "Status"]
