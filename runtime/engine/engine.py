"""The serving engine: requests in, token streams out, one scheduled step at a time.

`LLMEngine` is synchronous and single-threaded by design (the async server drives it from one
thread). It schedules, runs the model, samples, detokenizes, applies stop conditions and frees
blocks the moment a request ends or is aborted. Requests are validated once, at the edge of the
process (`check_request`), not again here.

Split mode adds one thing: a request may be *remote*, its prompt's K/V computed by a prefill
worker into blocks reserved here. The protocol that fills them lives in runtime/disagg; the
engine only calls it through `KVConnector` and takes its results (`remote_prefilled`,
`prefill_locally`, `fail`, `release_blocks`) on the engine thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from phasesplit.runtime.engine.block_manager import BlockManager
from phasesplit.runtime.engine.grammar import GrammarError, Grammars, grammar_text
from phasesplit.runtime.engine.model_runner import LayerStream, ModelRunner, RunnerConfig
from phasesplit.runtime.engine.sampling import Sampler, choice_seed, logprobs_of
from phasesplit.runtime.engine.scheduler import ScheduledBatch, Scheduler
from phasesplit.runtime.engine.sequence import Sequence, Status
from phasesplit.runtime.engine.step_costs import (
    STEP_AIM,
    LinearCost,
    StepTimeBudget,
    efficient_chunk,
    pause_for_remote,
)
from phasesplit.runtime.model.loader import resolve
from phasesplit.runtime.model.tokenizer import IncrementalDecoder, TextTokenizer
from phasesplit.runtime.request import RequestError, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    # Seconds a step with decode rows may take (None: no limit): prompt chunks beside running
    # streams are cut to fit it by the measured step cost (scheduler.py). A split decode worker
    # with adaptive placement sets it to its --itl-target.
    itl_target_s: float | None = None
    # Cap every step's prompt tokens where the step's fixed cost falls to this share of it
    # (step_costs.efficient_chunk, from the measured prompt-step cost); None or 0: chunks fill
    # max_num_batched_tokens. Off for the library (offline batches want throughput only); the
    # server's --chunk-overhead turns it on (step_costs.CHUNK_OVERHEAD).
    chunk_overhead: float | None = None
    # A split decode worker whose prefill workers borrow its CPU (`up --pin-cpus`): the ITL
    # target by which it leaves that CPU to a short remote prefill of its own while its streams
    # are ahead of the target's pace (step_costs.pause_for_remote); None: never.
    remote_pause_target_s: float | None = None


class EngineObserver:
    """Hooks for metrics; the default does nothing so the engine has no metrics dependency."""

    def on_scheduled(self, seq: Sequence) -> None: ...
    def on_token(self, seq: Sequence, now: float) -> None: ...
    def on_finished(self, seq: Sequence, now: float) -> None: ...
    def on_step(self, batch: ScheduledBatch, seconds: float) -> None: ...


class KVConnector:
    """What the engine asks of the remote-prefill protocol (runtime/disagg), on the engine thread.

    Decode worker: `reserved` when a remote request's blocks are reserved (start filling them;
    False: prefill it here instead), `release` when they are dropped before its K/V arrived
    (abort, failure, fallback). Prefill worker: `begin_step` per step, returning which K/V the
    step streams out and where to (a LayerStream), or None. The defaults do nothing.
    """

    def reserved(self, seq: Sequence) -> bool:
        return True

    def release(self, seq: Sequence) -> bool:
        """True: the blocks may be freed now. False: a frame is still landing in them; the
        connector keeps them and hands them back with `LLMEngine.release_blocks` later."""
        return True

    def begin_step(self, batch: ScheduledBatch) -> LayerStream | None:
        return None


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
        self.connector = KVConnector()
        self.eos_ids = set(self.runner.cfg.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}  # by sequence id: a request's id, "<id>#<i>" for choice i > 0
        self.groups: dict[str, list[Sequence]] = {}  # request id -> its choices
        self.forks: dict[str, list[Sequence]] = {}  # request id -> choices waiting for its prompt's K/V
        self._grammars: Grammars | None = None
        self._tokenizer_json = files.folder / "tokenizer.json"
        self.streams: dict[str, _Stream] = {}
        self.outputs_pending: list[RequestOutput] = []
        self.remote_waiting: list[Sequence] = []  # split decode: waiting for blocks to reserve
        self.step_cost = LinearCost()  # seconds per step by tokens in it
        # The same, of steps that carry prompt tokens only: what prefilling here costs (split
        # placement and the ITL-capped chunks read it). Apart, because a step's cost is not one
        # line: decode rows ride on the weight stream, prompt rows past a few are compute (on
        # the AVX2 core 2 decode rows + 8 prompt tokens took 110 ms against 35 ms for the 2 alone,
        # and a fit through both kinds of step put that step at 80).
        self.prompt_step_cost = LinearCost()
        # And of steps with no prompt token, by decode rows: the step that ends a pause for a
        # remote prefill (remote_pause), and how near its ITL target this worker's batch runs
        # (the router lends a prefill worker requests only past a share of it).
        self.decode_step_cost = LinearCost()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def grammars(self) -> Grammars:
        """Built on the first constrained request: setting up the vocabulary costs ~1 s."""
        if self._grammars is None:
            self._grammars = Grammars(self._tokenizer_json, sorted(self.eos_ids), self.runner.cfg.vocab_size)
        return self._grammars

    # -- requests ---------------------------------------------------------------------------

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestError for a request that could never complete (the process's edge calls it)."""
        params.validate(self.tokenizer.vocab_size)
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
        if params.guided is not None:
            try:
                grammar_text(params.guided)
            except GrammarError as e:
                raise RequestError(str(e), e.param) from None


    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, remote: bool = False, arrival: float | None = None) -> Sequence:
        """Queue a checked request. remote: its prompt is prefilled by another worker into
        blocks reserved here (split decode); prefill_only: stop after the first token (split prefill).
        arrival: when it was handed over (time.monotonic()), if earlier than now: a server's engine
        takes requests in between steps, and that wait is queueing too."""
        seq = self._new_request(request_id, prompt_ids, params, remote, prefill_only, arrival)
        if remote:
            self.remote_waiting.append(seq)
            self._reserve_remote()
        else:
            self.scheduler.add(seq)
        return seq

    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, remote: bool,
                     prefill_only: bool, arrival: float | None = None) -> Sequence:
        """A request's sequences: choice 0 runs the prompt; with n > 1 (or best_of) the other
        choices wait for its K/V and then fork its blocks (`_fork`), each with its own seed stream."""
        if request_id in self.groups:
            raise RequestError(f"duplicate request id {request_id!r}")
        n = 1 if prefill_only else params.num_seqs  # a prefill worker computes the shared prompt once
        seqs = []
        for i in range(n):
            p = params if i == 0 else replace(params, seed=choice_seed(params.seed, i), prompt_logprobs=None)
            sid = request_id if i == 0 else f"{request_id}#{i}"
            status = Status.REMOTE_PREFILL if remote and i == 0 else Status.WAITING
            seqs.append(Sequence(sid, list(prompt_ids), p, status=status, prefill_only=prefill_only,
                                 group=request_id, index=i))
        if arrival is not None:
            for seq in seqs:
                seq.arrival = min(seq.arrival, arrival)
        if params.guided is not None:  # compiled per sequence: each choice walks the grammar on its own
            try:
                for seq in seqs:
                    seq.matcher = self.grammars.matcher(seq.params.guided)
            except GrammarError as e:
                raise RequestError(str(e), e.param) from None
        for seq in seqs:
            self.seqs[seq.request_id] = seq
            self.streams[seq.request_id] = _Stream(self.tokenizer, seq.params.stop)
        self.groups[request_id] = seqs
        if n > 1:
            self.forks[request_id] = seqs[1:]
        return seqs[0]

    def _fork(self, parent: Sequence) -> None:
        """The parent's prompt is computed: its sibling choices share its blocks from here."""
        now = time.monotonic()
        for child in self.forks.pop(parent.group, []):
            if child.status is Status.FINISHED:
                continue
            child.first_scheduled = now
            self.observer.on_scheduled(child)
            if self.blocks.fork(parent, child):
                child.status = Status.RUNNING
                self.scheduler.running.append(child)
            else:  # no room now: queue it like a new request (the prefix cache may still share)
                self.scheduler.add(child)

    def abort(self, request_id: str) -> bool:
        """Stop a request (all its choices) and free its blocks at once. False if it was not known."""
        seqs = self.groups.get(request_id)
        if seqs is None:
            return False
        now = time.monotonic()
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                seq.finish_reason = "abort"
                self._finish(seq, now)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.outputs_pending) or bool(self.remote_waiting)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for KV blocks: queued or preempted, and (split decode) remote ones
        not yet reserved. The one definition every state endpoint and gauge reports."""
        return len(self.scheduler.waiting) + len(self.remote_waiting)

    def state(self) -> dict[str, int]:
        """Request and block counts (state endpoints; tests check that nothing is stranded)."""
        sched = self.scheduler
        # Prompt tokens still to compute, part-way prompts included: what the router balances on.
        partial = sum(s.uncomputed for s in sched.running if s.uncomputed > 1)
        return {"running": len(sched.running), "waiting": self.num_waiting, "requests": len(self.seqs),
                "waiting_tokens": sched.waiting_tokens, "queued_tokens": sched.waiting_tokens + partial,
                "allocated_blocks": self.blocks.num_allocated, "free_blocks": self.blocks.num_free,
                "total_blocks": self.blocks.num_blocks}

    def next_decode_step_s(self) -> float | None:
        """Seconds a decode step of the running batch and one stream more is fitted to take;
        None before a decode-only step ran here."""
        if not self.decode_step_cost.count:
            return None
        return self.decode_step_cost.predict(len(self.scheduler.running) + 1)

    # -- split mode, decode side: results of the remote prefill (runtime/disagg/decode.py) ------

    def _reserve_remote(self) -> None:
        # Reserved requests join the batch when their K/V lands: they count against --max-num-seqs
        # now, so the batch never outgrows it and requests beyond it wait here, as local ones wait
        # in the scheduler (the first of a queue of long generations then finish after one batch's
        # time, not all of them after the whole queue's).
        reserved = sum(1 for s in self.seqs.values() if s.status is Status.REMOTE_PREFILL and s.block_table)
        while (self.remote_waiting and len(self.scheduler.running) + reserved < self.scheduler.max_num_seqs
               and self.blocks.can_allocate(self.remote_waiting[0])):
            reserved += 1
            seq = self.remote_waiting.pop(0)
            self.blocks.allocate(seq)  # prefix-cache hits here need not be sent
            seq.first_scheduled = time.monotonic()
            self.observer.on_scheduled(seq)
            if not self.connector.reserved(seq):  # computed here after all, from its cached prefix on
                seq.status = Status.RUNNING
                self.scheduler.running.append(seq)

    def remote_prefilled(self, request_id: str, first_token: int, transfer_s: float | None = None,
                         logprob: dict[str, Any] | None = None,
                         prompt_logprobs: list[dict[str, Any] | None] | None = None,
                         kv: tuple[int, Any] | None = None, *, remote_queued_s: float | None = None,
                         remote_prefill_s: float | None = None) -> bool:
        """The prompt's K/V arrived: join the running batch with the prefill's first token (and
        its logprob, and the prompt's, when the request asked for them); other choices fork it.
        `kv` (first position, [2, layers, tokens, kv_heads, head_dim]): K/V that landed outside
        the cache (a tensor-parallel decode worker), stored now, while the blocks are still ours."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not Status.REMOTE_PREFILL or not seq.block_table:
            return False
        if kv is not None:
            self.runner.write_kv(seq, *kv)
        seq.num_computed = len(seq.prompt_ids)
        seq.kv_transfer_s = transfer_s
        seq.remote_queued_s, seq.remote_prefill_s = remote_queued_s, remote_prefill_s
        if prompt_logprobs is not None and seq.prompt_lp is not None:
            seq.prompt_lp = list(prompt_logprobs)
        self.blocks.register_computed(seq)
        seq.status = Status.RUNNING
        self.scheduler.running.append(seq)
        self._fork(seq)
        self.outputs_pending.append(self._append_token(seq, first_token, time.monotonic(), logprob))
        return True

    def prefill_locally(self, request_id: str) -> bool:
        """Fall back to computing the prompt here (a failed remote prefill)."""
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
        """Free a remote-prefill sequence's reservation, unless a frame is landing in it: then
        the connector keeps the blocks and returns them through release_blocks."""
        if seq.block_table and not self.connector.release(seq):
            seq.block_table = []
            seq.num_registered = 0
            return
        self.blocks.free_seq(seq)

    def release_blocks(self, blocks: list[int]) -> None:
        """Blocks the connector kept while a frame landed in them: quiet now, reusable."""
        self.blocks.free_blocks(blocks)

    def fail(self, request_id: str, message: str) -> None:
        """End a request (all its choices) with an error the client will see."""
        for seq in self.groups.get(request_id, []):
            if seq.status is Status.FINISHED:
                continue
            seq.finish_reason = "error"
            self._finish(seq, time.monotonic())
            self.outputs_pending.append(RequestOutput(
                request_id, [], "", finished=True, finish_reason="error", prompt_tokens=len(seq.prompt_ids),
                completion_tokens=len(seq.output_ids), error=message, index=seq.index))

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs made outside a step (a remote prefill's first token, failures), for the caller
        to send now: left for `step`, a first token would wait for the next forward pass."""
        outputs, self.outputs_pending = self.outputs_pending, []
        return outputs

    # -- stepping ---------------------------------------------------------------------------

    def prompt_step_fit(self) -> tuple[float, float]:
        """(base, per token) of a step that carries prompt tokens; every step's fit until one ran."""
        return self.prompt_step_cost.fit(prior=self.step_cost.fit())

    def time_budget(self) -> StepTimeBudget | None:
        """The ITL target as the scheduler applies it, from this worker's fitted step cost."""
        if not self.config.itl_target_s:
            return None
        base, per_token = self.prompt_step_fit()
        return StepTimeBudget(self.config.itl_target_s * STEP_AIM, base, per_token)

    def remote_pause(self) -> float:
        """Seconds to wait before the next step (0: step now): a split decode worker leaves its
        CPU to the prefill worker that borrows it while a short remote prefill of its own runs and
        its streams are ahead of the ITL pace (step_costs.pause_for_remote). Never while a prompt
        waits or is in chunks here: a pause would hold it up too."""
        target = self.config.remote_pause_target_s
        if not target or self.scheduler.waiting:
            return 0.0
        now = time.monotonic()
        remote = [(s.remote_estimate_s, now - s.remote_started) for s in self.seqs.values()
                  if s.status is Status.REMOTE_PREFILL and s.remote_started is not None
                  and s.remote_estimate_s is not None]
        if not remote:
            return 0.0
        streams = []
        for s in self.scheduler.running:
            if s.uncomputed > 1:
                return 0.0
            if s.status is Status.RUNNING and s.first_token_time is not None:
                last = s.last_token_time or s.first_token_time
                streams.append((len(s.output_ids), now - s.first_token_time, now - last))
        return pause_for_remote(target, streams, remote, self.decode_step_cost.predict(len(streams)))

    def chunk_tokens(self) -> int | None:
        """The most prompt tokens a step carries by EngineConfig.chunk_overhead (None: no cap)."""
        if not self.config.chunk_overhead:
            return None
        return efficient_chunk(*self.prompt_step_fit(), self.config.chunk_overhead)

    def step(self) -> list[RequestOutput]:
        self._reserve_remote()
        outputs, self.outputs_pending = self.outputs_pending, []
        batch = self.scheduler.schedule(self.time_budget(), self.chunk_tokens())
        if batch.empty:
            return outputs
        now = time.monotonic()
        for seq, _ in batch.prefill:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
                self.observer.on_scheduled(seq)
        stream = self.connector.begin_step(batch)  # split prefill: streams each layer's K/V out
        t0 = time.perf_counter()
        # Constrained rows' masks depend only on tokens already accepted: compute them on the
        # grammar thread while the forward pass runs (llguidance releases the GIL), not after it.
        to_sample = batch.decode + [seq for seq, chunk in batch.prefill if seq.num_computed + chunk == len(seq)]
        constrained = [seq for seq in to_sample if seq.matcher is not None]
        masks = self.grammars.allowed_async([seq.matcher for seq in constrained]) if constrained else None
        sampled, logits, prompt_logits = self.runner.run(batch, stream)
        for seq, _ in batch.prefill:
            self.blocks.register_computed(seq)
        for seq, first, rows in prompt_logits:
            k = seq.params.prompt_logprobs or 0
            seq.prompt_lp.extend(logprobs_of(rows, seq.prompt_ids[first : first + len(rows)], [k] * len(rows)))
        for seq in sampled:
            if seq.index == 0 and seq.group in self.forks and not seq.output_ids and not seq.prefill_only:
                self._fork(seq)
        # Logprobs are of the model's own distribution: taken before bans and grammar masks.
        want = [i for i, s in enumerate(sampled) if s.params.logprobs is not None or _ranked(s.params)]
        raw = logits[want].clone() if want else None
        allowed = None
        if masks is not None:
            row = {id(seq): i for i, seq in enumerate(sampled)}
            allowed = {row[id(seq)]: m for seq, m in zip(constrained, masks.result(), strict=True)}
        banned = [self._banned(s) for s in sampled]
        tokens = self._sample(sampled, logits, banned, allowed)
        keep = [j for j, i in enumerate(want) if tokens[i] is not None]  # rows whose sampling failed: none
        lps: list[dict[str, Any] | None] = [None] * len(sampled)
        if keep:
            rows = [want[j] for j in keep]
            got = logprobs_of(raw[keep], [tokens[i] for i in rows], [sampled[i].params.logprobs or 0 for i in rows])
            for i, lp in zip(rows, got, strict=True):
                lps[i] = lp
        now = time.monotonic()
        for seq, token, lp in zip(sampled, tokens, lps, strict=True):
            if token is None or seq.status is Status.FINISHED:  # its request failed alone (self.fail)
                continue
            outputs.append(self._append_token(seq, token, now, lp))
        outputs.extend(self.take_outputs())  # the failures
        seconds = time.perf_counter() - t0
        self.step_cost.observe(batch.num_tokens, seconds)
        if batch.prefill:
            self.prompt_step_cost.observe(batch.num_tokens, seconds)
        else:  # unmeasured meanwhile: every step's fit, kept fresh, gains on it (step_costs.STALE_HALFLIFE)
            self.prompt_step_cost.fade()
            self.decode_step_cost.observe(batch.num_tokens, seconds)
        self.observer.on_step(batch, seconds)
        return outputs

    def _sample(self, sampled: list[Sequence], logits, banned: list[list[int]],
                allowed: dict[int, Any] | None) -> list[int | None]:
        """One token per sequence. If the batch's sampling fails, each row is sampled alone and
        a row that still fails fails its own request (None), not the step."""
        indices = [len(s.output_ids) for s in sampled]
        try:
            return self.sampler.sample(logits, [s.params for s in sampled], banned, indices, allowed)
        except Exception:  # noqa: BLE001 - find the request that brought the fault in
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(sampled))
            tokens: list[int | None] = []
            for i, seq in enumerate(sampled):
                mask = {0: allowed[i]} if allowed and i in allowed else None
                try:
                    tokens.append(self.sampler.sample(logits[i : i + 1], [seq.params], [banned[i]], [indices[i]],
                                                      mask)[0])
                except Exception as e:  # noqa: BLE001
                    tokens.append(None)
                    self.fail(seq.group, f"sampling failed: {e}")
            return tokens

    def _banned(self, seq: Sequence) -> list[int]:
        if len(seq.output_ids) >= seq.params.min_tokens:
            return []
        return sorted(self.eos_ids | set(seq.params.stop_token_ids))

    def _append_token(self, seq: Sequence, token: int, now: float, lp: dict[str, Any] | None = None
                      ) -> RequestOutput:
        seq.output_ids.append(token)
        if seq.matcher is not None:
            self.grammars.advance(seq.matcher, token)
        if lp is not None:
            seq.cumulative_logprob += lp["logprob"]
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
        out = RequestOutput(seq.group, [token], text, prompt_tokens=len(seq.prompt_ids),
                            completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached_prompt,
                            index=seq.index)
        if p.logprobs is not None and lp is not None:
            out.logprobs = [lp]
        if seq.prompt_lp is not None and not seq.prompt_lp_sent:
            out.prompt_logprobs, seq.prompt_lp_sent = seq.prompt_lp, True
        if reason is not None:
            if not stopped:
                out.text += self.streams[seq.request_id].flush()
            seq.finish_reason = reason
            out.finished, out.finish_reason = True, reason
            out.timing = _timing(seq, now)
            if _ranked(p):
                out.cumulative_logprob = seq.cumulative_logprob
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
        group = self.groups.get(seq.group, [])
        if all(s.status is Status.FINISHED for s in group):
            self.groups.pop(seq.group, None)
            self.forks.pop(seq.group, None)
        self.observer.on_finished(seq, now)

    def close(self) -> None:
        """Stop the model's other tensor-parallel ranks (a no-op without TP)."""
        self.runner.close()

    # -- offline use --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); returns output ids in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.check_request(len(prompt), p)
            self.add_request(rid, prompt, p)
        while any(rid in self.groups for rid in ids):
            for out in self.step():
                if out.request_id in results and out.index == 0:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]

    def run_to_end(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[RequestOutput]:
        """Run one checked request (all its choices) to completion; returns every output in order."""
        self.check_request(len(prompt_ids), params)
        self.add_request(request_id, prompt_ids, params)
        outs: list[RequestOutput] = []
        while request_id in self.groups:
            outs.extend(o for o in self.step() if o.request_id == request_id)
        return outs


def _ranked(p: SamplingParams) -> bool:
    """best_of > n: the choices are ranked by their cumulative logprob, so every token's is needed."""
    return p.best_of is not None and p.best_of > p.n


def _timing(seq: Sequence, now: float) -> dict[str, float]:
    """Where the request's time went (the bench tool reads it from the last chunk)."""
    scheduled = seq.first_scheduled or seq.arrival
    first = seq.first_token_time or now
    t = {"queued_s": scheduled - seq.arrival, "prefill_s": first - scheduled, "decode_s": now - first}
    if seq.kv_transfer_s is not None:  # split: the layer-wise transfer overlaps the remote prefill
        t["kv_transfer_s"] = seq.kv_transfer_s
    if seq.remote_queued_s is not None and seq.remote_prefill_s is not None:
        # A remote prefill_s, taken apart: the prefill worker's queue and compute as it measured
        # them, and the rest: the calls, the wake-ups and the decode engine taking the K/V in.
        t["remote_queued_s"], t["remote_prefill_s"] = seq.remote_queued_s, seq.remote_prefill_s
        t["remote_hop_s"] = max(0.0, t["prefill_s"] - seq.remote_queued_s - seq.remote_prefill_s)
    return t
