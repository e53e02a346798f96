"""The openAPIV3Schema of a CustomResourceDefinition, as the JSON Schema tests/test_k8s.py validates manifests against.

    git -C <jobset clone> show v0.12.0:config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml \
        | python k8s/crds/extract.py v1alpha2 > k8s/crds/jobset.x-k8s.io_v1alpha2_JobSet.json

Reads one CRD (YAML) on stdin and writes the schema of the version named on the command line. `description`
fields are dropped (they are 80 % of the bytes and no part of validation); nothing else is changed. Kubernetes'
own extensions (x-kubernetes-*, `int-or-string`) are kept: jsonschema ignores unknown keywords, and
tests/test_k8s.py maps int-or-string to "integer or string". k8s/crds/SOURCES.md names the release of each file.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml


def strip_descriptions(node):
    """`node` without `description` keys at any depth (a property *named* description is kept)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "properties":
                out[key] = {name: strip_descriptions(v) for name, v in value.items()}
            elif key != "description":
                out[key] = strip_descriptions(value)
        return out
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main() -> int:
    parser = argparse.ArgumentParser(description="Write the JSON Schema of one version of the CRD read on stdin "
                                     "(descriptions dropped).", epilog="k8s/crds/SOURCES.md names each file's release")
    parser.add_argument("version", help="the CRD version whose openAPIV3Schema to write, e.g. v1alpha2")
    version = parser.parse_args().version
    crd = yaml.safe_load(sys.stdin)
    if not isinstance(crd, dict) or not isinstance(crd.get("spec"), dict) or "versions" not in crd["spec"]:
        print("error: stdin holds no CustomResourceDefinition (spec.versions)", file=sys.stderr)
        return 2
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    if version not in versions:
        print(f"error: {crd['metadata']['name']} has no version {version} (it has {sorted(versions)})",
              file=sys.stderr)
        return 2
    json.dump(strip_descriptions(versions[version]["schema"]["openAPIV3Schema"]), sys.stdout,
              separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
