"""What the Kubeflow operators do with a manifest, written out from their source, for engine/tests/test_kubernetes.py:
the variables each pod gets, the command its container runs, and a strict check against the operator's CRD schema.

- PyTorchJob (Training Operator v1, kubeflow/training-operator release-1.9, pkg/controller.v1/pytorch/envvar.go and
  master.go): every pod gets PYTHONUNBUFFERED=1, MASTER_ADDR and PET_MASTER_ADDR = `<job>-master-0`, MASTER_PORT and
  PET_MASTER_PORT = the `pytorchjob-port` of the master's `pytorch` container, WORLD_SIZE = all replicas x
  nprocPerNode (1 unless it is a number), RANK and PET_NODE_RANK = the pod's index (workers count from 1: the master
  is 0), PET_NPROC_PER_NODE = nprocPerNode, PET_NNODES = all replicas (no elasticPolicy).
- TrainJob (Trainer v2, kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go): only torchrun's variables,
  PET_NNODES = numNodes, PET_NPROC_PER_NODE = numProcPerNode, PET_NODE_RANK = the pod's job-completion index,
  PET_MASTER_ADDR = `<job>-node-0-0.<job>`, PET_MASTER_PORT = 29500 (constants.ContainerTrainerPort).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas"
TRAINJOB_MASTER_PORT = 29500


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused, as `kubectl apply --validate=strict` does: every object that
    lists its properties and neither allows others nor preserves unknown fields gets additionalProperties: false."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    preserves_unknown = out.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserves_unknown:
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    return out


def crd_schema(kind: str) -> dict[str, Any]:
    """The vendored schema (engine/tests/schemas/) of the operator's CRD for `kind`."""
    (path,) = [p for p in SCHEMAS.glob("*.json") if json.loads(p.read_text())["kind"] == kind]
    return json.loads(path.read_text())


def validation_errors(manifest: dict[str, Any]) -> list[str]:
    """Every way `manifest` breaks its CRD's schema (or names another API version), as one line each."""
    crd = crd_schema(manifest.get("kind", ""))
    expected = f"{crd['group']}/{crd['version']}"
    version = manifest.get("apiVersion")
    errors = [] if version == expected else [f"apiVersion {version} != {expected}"]
    validator = jsonschema.Draft7Validator(strict(crd["schema"]))
    errors += [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
    return errors


def pytorchjob_pods(job: dict[str, Any]) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """(pod name, operator's variables, container) of every pod of a PyTorchJob, master first."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    nproc = str(spec.get("nprocPerNode", "auto"))
    total = sum(r["replicas"] for r in replicas.values())
    master = container(replicas["Master"]["template"], "pytorch")
    (port,) = [p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port"]
    address = f"{job['metadata']['name']}-master-0"
    pods = []
    for kind in ("Master", "Worker"):
        for index in range(replicas.get(kind, {}).get("replicas", 0)):
            rank = index + (kind == "Worker")
            env = {
                "PYTHONUNBUFFERED": "1",
                "MASTER_PORT": str(port),
                "PET_MASTER_PORT": str(port),
                "MASTER_ADDR": address,
                "PET_MASTER_ADDR": address,
                "WORLD_SIZE": str(total * (int(nproc) if nproc.isdigit() else 1)),
                "RANK": str(rank),
                "PET_NODE_RANK": str(rank),
                "PET_NPROC_PER_NODE": nproc,
                "PET_NNODES": str(total),
            }
            pod = f"{job['metadata']['name']}-{kind.lower()}-{index}"
            pods.append((pod, env, container(replicas[kind]["template"], "pytorch")))
    return pods


def trainjob_pods(job: dict[str, Any]) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """(pod name, operator's variables, trainer settings) of every node pod of a TrainJob."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    return [
        (
            f"{name}-node-0-{index}",
            {
                "PET_NNODES": str(trainer["numNodes"]),
                "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
                "PET_NODE_RANK": str(index),
                "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
                "PET_MASTER_PORT": str(TRAINJOB_MASTER_PORT),
            },
            trainer,
        )
        for index in range(trainer["numNodes"])
    ]


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in template["spec"]["containers"] if c["name"] == name]
    return copy.deepcopy(found)


def command(spec: dict[str, Any]) -> list[str]:
    """What the container runs: its command, then its args."""
    return [*spec.get("command", []), *spec.get("args", [])]
