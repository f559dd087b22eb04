"""`phasesplit operator`: run the InferenceService controller.

Imports only the standard library at module level: the runtime's CLI imports this module to
register the subcommand, and `phasesplit serve` must not pay for kopf and the Kubernetes client.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable; default: the whole cluster)")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig file (default: in-cluster credentials, else $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="URL to serve the liveness probe on ('' to disable)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve the operator's Prometheus metrics on this port at /metrics (default 0: off)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    if args.kubeconfig:
        # Both kopf's login and our API client read $KUBECONFIG; set it once for both.
        os.environ["KUBECONFIG"] = os.path.abspath(args.kubeconfig)

    import kopf

    from phasesplit.operator import handlers  # registers the handlers on import
    from phasesplit.operator.telemetry import OperatorTelemetry

    telemetry = OperatorTelemetry()
    if args.metrics_port:
        telemetry.serve(args.metrics_port)

    kopf.configure(verbose=args.log_level == "debug", debug=args.log_level == "debug")
    logging.getLogger().setLevel(args.log_level.upper())
    asyncio.run(kopf.operator(
        settings=handlers.settings(namespaced=bool(args.namespace)),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        standalone=True,
        memo=kopf.Memo(telemetry=telemetry),
    ))
    return 0
