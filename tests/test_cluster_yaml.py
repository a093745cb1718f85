"""cluster.yaml is a valid Ray cluster-launcher config that installs this checkout everywhere."""

from __future__ import annotations

import os

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load() -> dict:
    with open(os.path.join(REPO, "cluster.yaml")) as f:
        return yaml.safe_load(f)


def test_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(load()))  # what `ray up` does first; raises on any violation


def test_cluster_yaml_ships_and_installs_nvray_and_has_gpu_workers():
    config = load()
    assert config["file_mounts"]["~/nvray"] == "."
    assert any("pip install -e" in c and "~/nvray" in c for c in config["setup_commands"])
    workers = {name: t for name, t in config["available_node_types"].items()
               if name != config["head_node_type"]}
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers.values())
