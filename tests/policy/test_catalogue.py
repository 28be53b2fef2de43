from __future__ import annotations

from pathlib import Path

import pytest

from policy.catalogue import load_catalogue, parse_catalogue
from policy.errors import CatalogueError

CATALOGUES = Path(__file__).resolve().parents[2] / "policy" / "catalogues"


@pytest.mark.parametrize("name", ["demo", "gpu-affinity", "speeds-1-2-4", "speeds-1-4-8"])
def test_shipped_catalogues_load(name: str) -> None:
    cat = load_catalogue(CATALOGUES / f"{name}.yaml")
    assert len(cat.pools) == 3
    states = cat.states()
    assert all(s.slots > 0 and s.busy == 0 for s in states)


def test_speeds_cluster_matches_the_issue() -> None:
    cat = load_catalogue(CATALOGUES / "speeds-1-2-4.yaml")
    assert [(p.vm_class.speed, p.workers) for p in cat.pools] == [(1.0, 8), (2.0, 4), (4.0, 2)]


def test_gpu_affinity_cluster_is_elastic() -> None:
    cat = load_catalogue(CATALOGUES / "gpu-affinity.yaml")
    assert all(p.elastic for p in cat.pools)
    assert cat.pool("gpu").vm_class.affinity["gpu_train"] > 1


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "vm_classes"),
        ({"vm_classes": {"a": {"cpus": 1, "memory_gb": 1}}}, "pools"),
        ({"vm_classes": {"a": {"cpus": 1, "memory_gb": 1}}, "pools": {"p": {"vm_class": "b"}}}, "pools.p.vm_class"),
        ({"vm_classes": {"a": {"cpus": -1, "memory_gb": 1}}, "pools": {"p": {"vm_class": "a"}}}, "vm_classes.a.cpus"),
        ({"vm_classes": {"a": {"cpus": 1, "memory_gb": 1}},
          "pools": {"p": {"vm_class": "a", "workers": 5, "max_workers": 2}}}, "min_workers <= workers"),
    ],
)
def test_bad_catalogues_name_the_field(doc: dict, message: str) -> None:
    with pytest.raises(CatalogueError, match=message):
        parse_catalogue(doc, "test.yaml")


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(CatalogueError, match="missing.yaml"):
        load_catalogue(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [unclosed")
    with pytest.raises(CatalogueError, match="not valid YAML"):
        load_catalogue(bad)
