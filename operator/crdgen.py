"""Generates the InferenceService CRD from the pydantic models in api.py.

    python -m phasesplit.operator.crdgen            # print the CRD YAML
    python -m phasesplit.operator.crdgen --write    # rewrite crds/ and the chart's copy

Pydantic emits JSON Schema 2020-12; the API server wants a structural OpenAPI v3 subset. This
module inlines $refs, turns Optional into "may be absent" (never null), maps exclusive bounds
and single-value Literals, and drops what Kubernetes rejects (titles, null defaults).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from phasesplit.operator import api

CRD_FILE = f"{api.GROUP}_{api.PLURAL}.yaml"
REPO = Path(__file__).resolve().parent.parent
CRD_PATHS = [REPO / "crds" / CRD_FILE, REPO / "charts" / "phasesplit" / "crds" / CRD_FILE]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline every $ref, keeping sibling keys (a field's description overrides the model's)."""
    if isinstance(node, list):
        return [_resolve(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _resolve(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        merged = dict(target)
        merged.update({k: _resolve(v, defs) for k, v in node.items() if k != "$ref"})
        return merged
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: Any) -> Any:
    """Rewrite one resolved JSON Schema node into Kubernetes' structural OpenAPI v3 form."""
    if isinstance(node, list):
        return [_structural(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    # Optional[X] is `anyOf: [X, {type: null}]`: absent means unset, so keep just X.
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) == 1:
            del node["anyOf"]
            inner = dict(options[0])
            inner.update(node)  # the field's own description/default win over the type's
            node = inner
    node.pop("title", None)
    if node.get("default", 0) is None:
        node.pop("default")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for key, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if key in node and not isinstance(node[key], bool):
            node[flag] = node.pop(key)
            node[key] = True
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _structural(prop) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value)
        elif key == "anyOf":
            out[key] = [_structural(x) for x in value]
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out:
        out.pop("additionalProperties", None)  # extra="forbid" becomes pruning, the Kubernetes way
    return out


def model_schema(model: type[api.ApiModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


def _condition_list(status: dict[str, Any]) -> None:
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["maxItems"] = 16


def crd() -> dict[str, Any]:
    spec = model_schema(api.InferenceServiceSpec)
    status = model_schema(api.InferenceServiceStatus)
    _condition_list(status)
    schema = {
        "type": "object",
        "description": "A model served with prefill and decode split into separately scaled pools.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    ready = '.status.conditions[?(@.type=="Ready")].status'
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "phasesplit", "app.kubernetes.io/part-of": "phasesplit"},
        },
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": api.SHORT_NAMES,
                "categories": ["phasesplit"],
            },
            "scope": "Namespaced",
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Ready", "type": "string", "jsonPath": ready},
                    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
                     "description": "ready/desired prefill workers"},
                    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
                     "description": "ready/desired decode workers"},
                    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


def render_yaml() -> str:
    header = "# Generated by `python -m phasesplit.operator.crdgen --write` from operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the CRD files in the repository")
    args = parser.parse_args(argv)
    text = render_yaml()
    if not args.write:
        sys.stdout.write(text)
        return 0
    for path in CRD_PATHS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
