"""The CRD is generated from the pydantic models and stays in sync; its schema is structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from phasesplit.operator import api, crdgen

ROOT = Path(__file__).resolve().parents[2]


def _schema() -> dict[str, Any]:
    return crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, prop in (node.get("properties") or {}).items():
        yield from _walk(prop, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_files_match_the_models():
    want = crdgen.render_yaml()
    for path in crdgen.CRD_PATHS:
        assert path.read_text() == want, f"{path} is stale: run python -m phasesplit.operator.crdgen --write"


def test_crd_identity():
    crd = crdgen.crd()
    assert crd["metadata"]["name"] == "inferenceservices.serving.phasesplit.io"
    assert crd["spec"]["names"]["shortNames"] == ["psvc"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Prefill", "Decode", "Endpoint", "Age"]


def test_every_field_has_a_description():
    missing = [path for path, node in _walk(_schema()["properties"]["spec"], "spec")
               if path and not path.endswith(("[]", "{}")) and not node.get("description")]
    missing += [path for path, node in _walk(_schema()["properties"]["status"], "status")
                if path and not path.endswith(("[]", "{}")) and not node.get("description")]
    assert missing == []


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        assert "$ref" not in node and "title" not in node and "const" not in node, path
        assert node.get("default", 0) is not None, path
        if node.get("x-kubernetes-int-or-string"):
            assert [o["type"] for o in node["anyOf"]] == ["integer", "string"], path
            continue
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert node["type"] == "object", path
            continue
        assert "anyOf" not in node and "type" in node, path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(key, True), bool), path
        if node["type"] == "object" and "properties" in node:
            assert "additionalProperties" not in node, path


def test_defaults_fill_the_minimal_object():
    """Sub-objects default to {} so the API server fills every nested default."""
    spec = _schema()["properties"]["spec"]["properties"]
    for name in ("runtime", "prefill", "decode", "router", "slo", "autoscaling", "kvTransfer"):
        assert spec[name]["default"] == {}, name
    assert spec["prefill"]["properties"]["replicas"]["default"] == 1
    assert spec["autoscaling"]["properties"]["mode"]["default"] == "Planner"
    assert _schema()["required"] == ["spec"]


def test_cel_rules_cover_the_cross_field_constraints():
    spec = _schema()["properties"]["spec"]
    rules = {r["rule"] for _, node in _walk(spec) for r in node.get("x-kubernetes-validations", [])}
    assert any("has(self.builtin)" in r and "has(self.hostPath)" in r for r in rules)
    assert "!has(self.minReplicas) || self.minReplicas <= self.replicas" in rules
    assert "!has(self.maxReplicas) || self.replicas <= self.maxReplicas" in rules
    assert "!has(self.min) || !has(self.max) || self.min <= self.max" in rules
    assert "duration(self) > duration('0s')" in rules
    assert any("kvTransfer.port != 8000" in r for r in rules)
    # CEL's cost estimate needs bounded strings wherever a rule reads one.
    for path, node in _walk(spec):
        if node.get("type") == "string" and any("duration(self)" in r["rule"] or "contains" in r["rule"]
                                                for r in node.get("x-kubernetes-validations", [])):
            assert node.get("maxLength"), path


def test_conditions_are_a_map_list():
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_chart_ships_the_same_crd_and_samples_validate():
    chart_crd = ROOT / "charts" / "phasesplit" / "crds" / crdgen.CRD_FILE
    assert yaml.safe_load(chart_crd.read_text()) == crdgen.crd()
    samples = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
    assert len(samples) >= 2
    for sample in samples:
        doc = yaml.safe_load(sample.read_text())
        assert (doc["apiVersion"], doc["kind"]) == (api.API_VERSION, api.KIND)
        api.InferenceServiceSpec.model_validate(doc["spec"])
