"""`phasesplit serve`: build the app for one role and run it under uvicorn."""

from __future__ import annotations

import argparse
import logging
import time

from fastapi import FastAPI

from phasesplit.runtime.internal_secret import SecretError
from phasesplit.runtime.model.files import ModelError

log = logging.getLogger("phasesplit")


def build_app(args: argparse.Namespace) -> FastAPI:
    # Imported per role: the router runs no model and must not load torch.
    if args.role == "router":
        from phasesplit.runtime.server.router import build_router_app

        return build_router_app(args)
    if args.role == "both":
        from phasesplit.runtime.server.worker import build_colocated_app

        return build_colocated_app(args)
    from phasesplit.runtime.server.split import build_decode_app, build_prefill_app

    return build_prefill_app(args) if args.role == "prefill" else build_decode_app(args)


def serve(args: argparse.Namespace) -> int:
    from phasesplit.runtime.server import drain

    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {args.role} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    t0 = time.perf_counter()
    try:
        app = build_app(args)
    except (ModelError, SecretError, ValueError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        return 2
    log.info("role %s ready in %.2fs on http://%s:%d", args.role, time.perf_counter() - t0, args.host, args.port)
    drain.run(app, args.host, args.port, drain.Drain(args.drain_timeout))
    return 0
