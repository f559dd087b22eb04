"""What every model-running role shares: the engine, its metrics and the debug routes, and the
colocated (`--role both`) app. The router runs no model and does not import this module.
"""

from __future__ import annotations

import argparse
import os

from fastapi import FastAPI

from phasesplit.runtime.engine.engine import EngineConfig, LLMEngine
from phasesplit.runtime.engine.model_runner import RunnerConfig
from phasesplit.runtime.server.admission import Admission
from phasesplit.runtime.server.async_engine import AsyncEngine, LocalBackend
from phasesplit.runtime.server.metrics import EngineMetrics, Metrics
from phasesplit.runtime.server.openai_api import build_openai_app, served_names


def engine_config(args: argparse.Namespace, phase: str = "both") -> EngineConfig:
    # A decode worker placing prompts adaptively keeps its ITL target in the steps that carry a
    # local prefill too (placement.py counts on it). A prefill worker does not, though the router
    # may lend it whole requests (routing.lend_prefill): cut to the target, its remote prefills
    # ran at half speed beside one lent stream and queued for seconds (docs/benchmarks.md).
    adaptive = phase == "decode" and args.prefill_placement == "adaptive"
    return EngineConfig(
        runner=RunnerConfig(device=args.device, dtype=args.dtype, block_size=args.block_size,
                            kv_cache_memory=args.kv_cache_memory, kv_cache_fraction=args.kv_cache_fraction,
                            max_model_len=args.max_model_len, threads=args.threads,
                            tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
                            borrow_cpus=args.borrow_idle_cpus),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=args.prefix_caching,
        itl_target_s=(args.itl_target or None) if adaptive else None,
        remote_pause_target_s=(args.itl_target or None) if phase == "decode" and args.pause_for_remote_prefill
        else None,
        chunk_overhead=args.chunk_overhead or None,
    )


def build_engine(args: argparse.Namespace, phase: str) -> tuple[LLMEngine, Metrics, str]:
    engine = LLMEngine(args.model, engine_config(args, phase))
    name = served_names(args, engine.model_name)[0]
    metrics = Metrics(name, phase)
    engine.observer = EngineMetrics(metrics, engine)
    metrics.bind(running=lambda: len(engine.scheduler.running),
                 # Split decode workers queue requests for KV before their prefill: those wait for
                 # blocks too, which is what the planner reads this gauge for (engine.num_waiting).
                 waiting=lambda: engine.num_waiting,
                 kv_usage=lambda: engine.blocks.usage,
                 queue_tokens=lambda: engine.scheduler.waiting_tokens)
    return engine, metrics, name


def worker_admission(args: argparse.Namespace, engine: LLMEngine) -> Admission:
    """The worker's limits: its running batch plus a bounded queue (default 4 batches), and the
    prompt tokens its KV cache holds plus a bounded backlog (default 4 caches)."""
    kv_tokens = engine.blocks.num_blocks * engine.blocks.block_size
    queued = args.max_queued_requests if args.max_queued_requests is not None else 4 * args.max_num_seqs
    queued_tokens = args.max_queued_tokens if args.max_queued_tokens is not None else 4 * kv_tokens
    return Admission(max_requests=args.max_num_seqs + queued, max_tokens=kv_tokens + queued_tokens)


def api_key(args: argparse.Namespace) -> str | None:
    """The key clients must send; None: no auth. Set but empty is an error (Guards refuses it)
    rather than a silent open door."""
    return os.environ.get(args.api_key_env)


def add_debug_routes(app: FastAPI, engine: LLMEngine) -> None:
    @app.get("/debug/state")
    async def state() -> dict:
        """Block and request counts: lets tests and operators see that nothing is stranded."""
        return engine.state()


def build_colocated_app(args: argparse.Namespace) -> FastAPI:
    engine, metrics, name = build_engine(args, "both")
    aengine = AsyncEngine(engine)
    app = build_openai_app(LocalBackend(aengine, worker_admission(args, engine)), served_names(args, engine.model_name),
                           metrics, ready=aengine.alive, api_key=api_key(args), alive=aengine.alive,
                           max_body=args.max_body_bytes)
    add_debug_routes(app, engine)
    app.router.on_shutdown.append(aengine.shutdown)
    return app
