"""Validate deploy/kuberay/raycluster.yaml against KubeRay's RayCluster CRD schema, offline.

The CRD is KubeRay's ``ray-operator/config/crd/bases/ray.io_rayclusters.yaml`` (about 1 MB,
not kept here); its ``openAPIV3Schema`` for the served version is checked with jsonschema
(the ``x-kubernetes-*`` extensions are ignored, as a plain validator does), and every field
must be one the schema names. Only the RayCluster
is checked: the Deployments and Services need Kubernetes' own schemas.

Usage::

    python deploy/kuberay/validate.py --crd ray.io_rayclusters.yaml [manifest.yaml ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

HERE = Path(__file__).resolve().parent


def schema_of(crd_path: Path, version: str) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text())
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            schema: dict[str, Any] = entry["schema"]["openAPIV3Schema"]
            return schema
    raise SystemExit(f"{crd_path} has no version {version}")


def unknown_fields(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    """Fields the schema does not name (the API server would drop them silently, as
    ``kubectl apply --validate=strict`` reports): a misspelt field is a setting never applied."""
    found: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{where}.{key}: unknown field")
            else:
                found += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{where}.{i}")
    return found


def problems(crd_path: Path, manifest: Path) -> list[str]:
    found: list[str] = []
    checked = 0
    for doc in yaml.safe_load_all(manifest.read_text()):
        if not doc or doc.get("kind") != "RayCluster":
            continue
        checked += 1
        version = doc["apiVersion"].split("/", 1)[1]
        schema = schema_of(crd_path, version)
        validator = jsonschema.Draft7Validator(schema)
        found += [f"{manifest.name}: {p}" for p in unknown_fields(doc, schema, "")]
        for error in validator.iter_errors(doc):
            where = ".".join(str(p) for p in error.absolute_path) or "(top)"
            found.append(f"{manifest.name}: {where}: {error.message}")
    if not checked:
        found.append(f"{manifest.name}: no RayCluster in it")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--crd", type=Path, required=True)
    parser.add_argument("manifests", type=Path, nargs="*", default=[HERE / "raycluster.yaml"])
    args = parser.parse_args(argv)
    found = [p for manifest in args.manifests for p in problems(args.crd, manifest)]
    for problem in found:
        print(problem)
    print(f"{len(args.manifests)} manifest(s): {'invalid' if found else 'valid'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
