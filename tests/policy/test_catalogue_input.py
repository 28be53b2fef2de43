"""Pool catalogues the wire or Celery cannot use are refused at load, naming the file and field.

Each test failed on the code before its fix; its docstring says what an operator saw.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from policy.catalogue import load_catalogue, parse_catalogue
from policy.errors import CatalogueError
from policy.schema import MAX_POOLS, PlacementRequest, ReadyTask, RunGraph, TaskNode, dumps, loads_json

GRAPH = RunGraph(run_key="r", tasks=(TaskNode("t0"),), edges=())

VM = "vm_classes:\n  small: {cpus: 4, memory_gb: 16}\n"


def _load_text(tmp_path: Path, text: str | bytes) -> object:
    path = tmp_path / "cat.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return load_catalogue(path)


def test_pool_names_that_are_equal_as_text_are_refused_as_duplicates(tmp_path: Path) -> None:
    """The catalogue promises that a pool listed twice is refused, not loaded twice or
    overwritten. A pool written ``1:`` (an integer key) and another ``"1":`` (a string key) pass
    the duplicate-key check (1 != "1") and then both become pool "1": two pools of one Celery
    queue, the request carries the name twice, ``Catalogue.pool("1")`` finds only the first.
    Expected: CatalogueError naming the duplicate."""
    text = VM + "pools:\n  1: {vm_class: small, workers: 2}\n  '1': {vm_class: small, workers: 9}\n"
    with pytest.raises(CatalogueError, match="'1'|duplicate|non-empty string"):
        _load_text(tmp_path, text)


def test_vm_class_names_that_are_equal_as_text_are_refused_as_duplicates(tmp_path: Path) -> None:
    """As pools: VM classes ``1:`` and ``"1":`` both load as class "1", the second silently
    replacing the first (a 9-CPU box where the file also says 1 CPU). Expected: CatalogueError."""
    text = ("vm_classes:\n  1: {cpus: 1, memory_gb: 1}\n  '1': {cpus: 9, memory_gb: 9}\n"
            "pools:\n  p: {vm_class: '1'}\n")
    with pytest.raises(CatalogueError, match="'1'|duplicate|non-empty string"):
        _load_text(tmp_path, text)


@pytest.mark.parametrize(("key", "loaded_as"), [("off", "False"), ("null", "None"), ("010", "8"), ("1.10", "1.1")])
def test_a_pool_name_yaml_reads_as_a_non_string_is_not_renamed_silently(
        tmp_path: Path, key: str, loaded_as: str) -> None:
    """YAML 1.1 reads the unquoted pool key ``off`` as a boolean, ``null`` (what a template with
    an unset variable leaves) as None, ``010`` as octal 8, ``1.10`` as 1.1; ``parse_catalogue``
    then ``str()``s the key, so the pool loads as queue "False", "None", "8", "1.1". The operator
    sees every task placed on a queue that no worker consumes. Expected: either the name as
    written, or a CatalogueError (e.g. asking to quote the name)."""
    try:
        cat = _load_text(tmp_path, VM + f"pools:\n  {key}: {{vm_class: small}}\n")
    except CatalogueError:
        return
    names = cat.names  # type: ignore[attr-defined]
    assert names == (key,), f"pool {key!r} loaded as {names!r}"
    assert loaded_as not in names


@pytest.mark.parametrize("doc", [
    {"vm_classes": {"a": {"cpus": 1, "memory_gb": 1}}, "pools": {"": {"vm_class": "a"}}},
    {"vm_classes": {"": {"cpus": 1, "memory_gb": 1}}, "pools": {"p": {"vm_class": ""}}},
], ids=["empty-pool-name", "empty-vm-class-name"])
def test_names_the_wire_refuses_are_refused_at_load(doc: dict) -> None:
    """A pool or VM class named "" (a template's ``"${POOL}"`` with the variable unset) loads, but
    the wire schema requires non-empty names: every request the executor builds from this
    catalogue is refused as bad_request, so every placement is a fallback (the same failure as
    the max_workers 1e9 review finding). Expected: CatalogueError at load."""
    with pytest.raises(CatalogueError):
        cat = parse_catalogue(doc, "test.yaml")
        # what happens on the wire when it loads: (this line documents the failure, it raises SchemaError)
        request = PlacementRequest("q", (ReadyTask("r", "t0"),), cat.states(), (GRAPH,))
        PlacementRequest.from_json(loads_json(dumps(request), max_bytes=1 << 24))


def test_more_pools_than_the_wire_takes_are_refused_at_load() -> None:
    """The wire takes at most ``MAX_POOLS`` (256) pools per request; a catalogue of 300 pools
    loads, and then every request the executor sends is refused ("request.pools: 300 entries,
    limit is 256"): every placement falls back. Expected: CatalogueError at load, as for
    max_workers past what the wire takes."""
    doc = {"vm_classes": {"a": {"cpus": 1, "memory_gb": 1}},
           "pools": {f"p{i}": {"vm_class": "a"} for i in range(MAX_POOLS + 44)}}
    with pytest.raises(CatalogueError, match=str(MAX_POOLS)):
        parse_catalogue(doc, "test.yaml")


@pytest.mark.parametrize("spec", [
    "{cpus: 1" + "0" * 400 + ", memory_gb: 16}",
    "{cpus: 4, memory_gb: 16, affinity: {gpu_train: 1" + "0" * 400 + "}}",
], ids=["cpus", "affinity"])
def test_a_huge_integer_is_a_catalogue_error_naming_the_field(tmp_path: Path, spec: str) -> None:
    """A 401-digit integer (a pasted byte count, a stray key held down) makes ``math.isfinite``
    raise OverflowError inside the validation: the executor or server fails to start with a bare
    "OverflowError: int too large to convert to float" naming neither the file nor the field,
    though the catalogue promises "errors name the file and the field" (the wire schema fixed the
    same case). Expected: CatalogueError naming cat.yaml and vm_classes.small."""
    try:
        _load_text(tmp_path, f"vm_classes:\n  small: {spec}\npools:\n  p: {{vm_class: small}}\n")
    except CatalogueError as exc:
        assert "cat.yaml" in str(exc) and "vm_classes.small" in str(exc)
    except Exception as exc:  # noqa: BLE001 - the bug: anything but a CatalogueError
        pytest.fail(f"{type(exc).__name__}: {exc}")
    else:
        pytest.fail("a 401-digit number loaded")


def test_a_catalogue_that_is_not_utf8_is_a_catalogue_error_naming_the_path(tmp_path: Path) -> None:
    """A catalogue saved in Latin-1 (an ``é`` in a comment) makes ``Path.read_text`` raise
    UnicodeDecodeError, which ``load_catalogue`` does not catch (only OSError): the executor
    fails to start with a bare "'utf-8' codec can't decode byte 0xe9" naming no file. Expected:
    either it loads, or a CatalogueError naming the path."""
    text = ("# pools of the caf\u00e9 cluster\n" + VM + "pools:\n  p: {vm_class: small}\n").encode("latin-1")
    try:
        cat = _load_text(tmp_path, text)
    except CatalogueError as exc:
        assert "cat.yaml" in str(exc)
    except Exception as exc:  # noqa: BLE001 - the bug: anything but a CatalogueError
        pytest.fail(f"{type(exc).__name__}: {exc}")
    else:
        assert cat.names == ("p",)  # type: ignore[attr-defined]
