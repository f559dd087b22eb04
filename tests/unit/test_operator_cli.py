"""`phasesplit operator`: the CLI plug-in contract and the kopf wiring."""

from __future__ import annotations

import subprocess
import sys

from phasesplit.operator import reconcile
from phasesplit.runtime.cli import build_parser


def test_cli_module_imports_only_the_standard_library():
    code = ("import sys; import phasesplit.operator.cli as c; "
            "heavy = [m for m in ('kopf', 'kubernetes', 'pydantic', 'yaml', 'torch') if m in sys.modules]; "
            "assert callable(c.add_arguments) and callable(c.run); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_operator_subcommand_flags():
    args = build_parser().parse_args(["operator", "--namespace", "a", "--namespace", "b", "--liveness", ""])
    assert args.command == "operator" and args.namespace == ["a", "b"] and args.liveness == ""
    args = build_parser().parse_args(["operator"])
    assert args.namespace == [] and args.liveness == "http://0.0.0.0:8080/healthz" and args.kubeconfig is None


def test_every_rendered_kind_is_watched_and_prunable():
    import kopf

    from phasesplit.operator import handlers

    watched = {kind for *_, kind in handlers.CHILD_RESOURCES}
    assert watched == set(reconcile.CHILD_KINDS)
    registry = kopf.get_default_registry()
    selectors = {(h.selector.group, h.selector.version, h.selector.any_name)
                 for h in registry._watching.get_all_handlers()}
    assert {(g, v, p) for g, v, p, _ in handlers.CHILD_RESOURCES} <= selectors
    parent = {(h.selector.group, h.selector.any_name) for h in registry._changing.get_all_handlers()}
    assert ("serving.phasesplit.io", "inferenceservices") in parent
