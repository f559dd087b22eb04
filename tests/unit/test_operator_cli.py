"""`phasesplit operator`: the CLI plug-in contract and the kopf wiring."""

from __future__ import annotations

import subprocess
import sys

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
    from phasesplit.operator import api, handlers, render

    # HPA mode with NetworkPolicies renders every kind there is.
    spec = api.InferenceServiceSpec.model_validate({"model": {"name": "m", "builtin": "smollm2"},
                                                    "autoscaling": {"mode": "HPA"}})
    rendered = {o["kind"] for o in render.render(render.Owner("a", "ns", "uid"), spec)}
    assert rendered == {k.kind for k in render.CHILD_KINDS}
    registry = handlers.registry()
    selectors = {(h.selector.group, h.selector.version, h.selector.any_name)
                 for h in registry._watching.get_all_handlers()}
    assert {(k.group, k.version, k.plural) for k in render.CHILD_KINDS} <= selectors
    assert ("serving.phasesplit.io", "v1alpha1", "inferenceservices") in selectors


def test_no_handler_needs_a_finalizer():
    """Only watch-event handlers: kopf puts no finalizer on InferenceServices, so deleting one (or
    its namespace) never waits for the operator."""
    from phasesplit.operator import handlers

    registry = handlers.registry()
    assert not registry._changing.get_all_handlers()
    assert not registry._spawning.get_all_handlers()
    assert not registry._indexing.get_all_handlers()


def test_lease_is_per_watch_scope():
    from phasesplit.operator.cli import lease_name

    assert lease_name([]) == "phasesplit-operator"
    assert lease_name(["a", "b"]) == lease_name(["b", "a", "a"]) != lease_name(["a"])
