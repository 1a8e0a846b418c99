"""deploy/kubernetes/triton.yaml parses, and says what docs/fleet.md says it says.

Structure only: the manifest is not applied to a cluster here (docs/fleet.md, "What was tested").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # PyYAML: in the test environment through transformers and ray (the test extra)

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kubernetes" / "triton.yaml"


def _documents() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["Deployment", "Service"], list(by_kind)
    return by_kind


def test_the_service_is_headless_and_selects_the_deployments_pods() -> None:
    docs = _documents()
    service, deployment = docs["Service"], docs["Deployment"]
    assert service["metadata"]["name"] == "triton-headless"  # the name in the client line of docs/fleet.md
    spec = service["spec"]
    assert spec["clusterIP"] == "None"  # the string "None": one DNS record per ready pod
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert {p["name"]: p["port"] for p in spec["ports"]} == {"grpc": 8001, "http": 8000, "metrics": 8002}


def test_the_pods_expose_the_ports_and_probe_triton_health() -> None:
    (container,) = _documents()["Deployment"]["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 8001, "http": 8000, "metrics": 8002}
    ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    assert (ready["path"], ports[ready["port"]]) == ("/v2/health/ready", 8000)
    assert (live["path"], ports[live["port"]]) == ("/v2/health/live", 8000)


def test_the_dockerfile_serves_on_the_ports_the_manifest_names() -> None:
    text = (ROOT / "deploy" / "kubernetes" / "Dockerfile").read_text()
    for flag, port in (("--http-port", 8000), ("--grpc-port", 8001), ("--metrics-port", 8002)):
        assert f'"{flag}", "{port}"' in text, flag
    assert '"--host", "0.0.0.0"' in text
