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
    parser.add_argument("--workers", type=int, default=16,
                        help="reconcile passes run in parallel (default 16: a pass mostly waits on the API server)")
    parser.add_argument("--resync-period", default="5m", metavar="DURATION",
                        help="re-list everything and reconcile every InferenceService this often (default 5m)")
    parser.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                        help="act only while holding a Lease, so replicas never fight (default: on)")
    parser.add_argument("--leader-election-namespace", default=None, metavar="NS",
                        help="namespace of the Lease (default: $POD_NAMESPACE, the pod's own namespace, "
                             "else the first --namespace, else 'default')")


def lease_name(namespaces: list[str]) -> str:
    """One Lease per watch scope: operators watching the same namespaces share (and contend for) it."""
    import hashlib

    if not namespaces:
        return "phasesplit-operator"
    scope = ",".join(sorted(set(namespaces)))
    return f"phasesplit-operator-{hashlib.sha256(scope.encode()).hexdigest()[:10]}"


def lease_namespace(args: argparse.Namespace) -> str:
    import os

    if args.leader_election_namespace:
        return args.leader_election_namespace
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip()
    except OSError:
        return args.namespace[0] if args.namespace else "default"


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import os

    if args.kubeconfig:
        # Both kopf's login and our API client read $KUBECONFIG; set it once for both.
        os.environ["KUBECONFIG"] = os.path.abspath(args.kubeconfig)

    import socket
    import uuid

    import kopf

    from phasesplit.operator import handlers
    from phasesplit.operator.controller import Controller, Settings
    from phasesplit.operator.kube import Kube, api_client
    from phasesplit.operator.telemetry import OperatorTelemetry
    from phasesplit.runtime.units import parse_duration

    telemetry = OperatorTelemetry()
    if args.metrics_port:
        telemetry.serve(args.metrics_port)

    kopf.configure(verbose=args.log_level == "debug", debug=args.log_level == "debug")
    logging.getLogger().setLevel(args.log_level.upper())
    if args.log_level != "debug":
        # kopf logs every handler call at INFO (one line per watch event of every child), httpx
        # every metrics scrape: per-tick chatter, not news.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    controller = Controller(Kube(api_client(args.kubeconfig)), Settings(
        namespaces=list(args.namespace), workers=args.workers,
        resync_s=parse_duration(args.resync_period, bare_unit="s"),
        leader_election=args.leader_election, lease_namespace=lease_namespace(args),
        lease_name=lease_name(args.namespace),
        identity=f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"), telemetry)
    asyncio.run(kopf.operator(
        registry=handlers.registry(),
        memo=handlers.memo(controller),
        settings=handlers.settings(namespaced=bool(args.namespace)),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        standalone=True,
    ))
    return 0
