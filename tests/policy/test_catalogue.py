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
        # found by review: "no limit" written as 1e9 loaded, and its slots (max_workers x slots_per_worker)
        # were past what the wire takes: the server refused every request
        ({"vm_classes": {"a": {"cpus": 1, "memory_gb": 1}},
          "pools": {"p": {"vm_class": "a", "workers": 1, "max_workers": 10**9}}}, r"max_workers: expected an integer in 0..100000"),
        ({"vm_classes": {"a": {"cpus": 1, "memory_gb": 1}},
          "pools": {"p": {"vm_class": "a", "slots_per_worker": 10**6}}}, r"slots_per_worker: expected an integer in 1..10000"),
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


# --- typos and impossible values are refused, naming the file, the entry and the key (found by review) ---


def _load_text(tmp_path: Path, text: str) -> object:
    path = tmp_path / "cat.yaml"
    path.write_text(text)
    return load_catalogue(path)


VM = "vm_classes:\n  small: {cpus: 4, memory_gb: 16}\n"


def test_misspelled_pool_keys_are_refused_not_defaulted(tmp_path: Path) -> None:
    # `worker`/`slot_per_worker` loaded as workers=1, slots_per_worker=1
    with pytest.raises(CatalogueError, match=r"cat\.yaml: pools\.p: unknown key 'worker'.*slots_per_worker") as e:
        _load_text(tmp_path, VM + "pools:\n  p: {vm_class: small, worker: 5, slot_per_worker: 8}\n")
    assert "did you mean 'workers'" in str(e.value)


def test_misspelled_vm_class_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CatalogueError, match=r"cat\.yaml: vm_classes\.small: unknown key 'sped'.*price_per_hour"):
        _load_text(tmp_path, "vm_classes:\n  small: {cpus: 4, memory_gb: 16, sped: 2.0}\n"
                             "pools:\n  p: {vm_class: small}\n")


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        (VM + "pools:\n  p: {vm_class: small, workers: 2}\n  p: {vm_class: small, workers: 9}\n", "p", 5),
        (VM + "pools:\n  p: {vm_class: small, workers: 2, workers: 9}\n", "workers", 4),
        (VM + "  small: {cpus: 8, memory_gb: 16}\npools:\n  p: {vm_class: small}\n", "small", 3),
    ],
    ids=["pool-twice", "field-twice", "vm-class-twice"],
)
def test_duplicate_keys_are_refused_not_overwritten(tmp_path: Path, text: str, key: str, line: int) -> None:
    with pytest.raises(CatalogueError, match=rf"cat\.yaml: line {line}: duplicate key '{key}'"):
        _load_text(tmp_path, text)


def test_merge_keys_may_still_override(tmp_path: Path) -> None:
    cat = _load_text(tmp_path, VM + "base: &base {vm_class: small, workers: 2}\n"
                                     "pools:\n  p: {<<: *base, workers: 3}\n")
    assert cat.pool("p").workers == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ["[small]", "{name: small}", "3"])
def test_vm_class_must_name_a_class(tmp_path: Path, value: str) -> None:
    # a list gave a bare TypeError (unhashable) naming neither the file nor the field
    with pytest.raises(CatalogueError, match=r"cat\.yaml: pools\.p\.vm_class: expected the name of a VM class"):
        _load_text(tmp_path, VM + f"pools:\n  p: {{vm_class: {value}}}\n")


@pytest.mark.parametrize("field", ["cpus", "memory_gb", "speed", "price_per_hour", "gpus"])
@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_numbers_must_be_finite(tmp_path: Path, field: str, value: str) -> None:
    spec = {"cpus": "4", "memory_gb": "16", field: value}
    body = ", ".join(f"{k}: {v}" for k, v in spec.items())
    with pytest.raises(CatalogueError, match=rf"cat\.yaml: vm_classes\.small\.{field}: expected a finite number"):
        _load_text(tmp_path, f"vm_classes:\n  small: {{{body}}}\npools:\n  p: {{vm_class: small}}\n")


@pytest.mark.parametrize("field", ["boot_delay_s", "idle_scale_down_s", "billing_s"])
def test_pool_durations_must_be_finite(tmp_path: Path, field: str) -> None:
    with pytest.raises(CatalogueError, match=rf"pools\.p\.{field}: expected a finite number"):
        _load_text(tmp_path, VM + f"pools:\n  p: {{vm_class: small, {field}: .inf}}\n")


def test_affinity_must_be_finite(tmp_path: Path) -> None:
    with pytest.raises(CatalogueError, match=r"vm_classes\.small\.affinity"):
        _load_text(tmp_path, "vm_classes:\n  small: {cpus: 4, memory_gb: 16, affinity: {gpu_train: .inf}}\n"
                             "pools:\n  p: {vm_class: small}\n")


def test_every_optional_key_is_still_accepted() -> None:
    cat = parse_catalogue({
        "vm_classes": {"v": {"cpus": 4, "memory_gb": 16, "gpus": 1, "speed": 2.0, "price_per_hour": 1.0,
                             "affinity": {"gpu_train": 8.0}}},
        "pools": {"p": {"vm_class": "v", "workers": 2, "slots_per_worker": 3, "min_workers": 0, "max_workers": 4,
                        "boot_delay_s": 90, "idle_scale_down_s": 100, "billing_s": 60}}}, "test.yaml")
    p = cat.pool("p")
    assert (p.slots, p.floor, p.max_workers, p.boot_delay_s, p.idle_scale_down_s, p.billing_s) == (6, 0, 4, 90, 100, 60)
    assert (p.vm_class.gpus, p.vm_class.speed_for("gpu_train")) == (1.0, 16.0)


@pytest.mark.parametrize("path", sorted(CATALOGUES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_packaged_catalogue_loads(path: Path) -> None:
    assert load_catalogue(path).pools
