"""WfFormat import: the shared real traces load; malformed input names the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policy.errors import SchemaError
from trainer.wfformat import load_wfformat, parse_wfformat, read_wfformat

TRACES = Path(__file__).resolve().parents[3] / "shared" / "workflows" / "wfinstances"


def _v15(tasks_spec, tasks_exec):
    return {"schemaVersion": "1.5", "name": "w",
            "workflow": {"specification": {"tasks": tasks_spec}, "execution": {"tasks": tasks_exec}}}


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared WfInstances are not checked out here")
def test_shared_traces_load():
    files = sorted(TRACES.glob("*.json"))
    assert files
    for f in files:
        trace = read_wfformat(f)
        assert trace.graph.run_key == f.stem
        assert all(t.duration_s > 0 for t in trace.graph.tasks)
    blast = read_wfformat(TRACES / "blast-chameleon-small-001.json")
    assert blast.read_bytes and blast.written_bytes
    assert {t.kind for t in blast.graph.tasks} >= {"blastall", "split_fasta"}


def test_v15_and_v14_parse_the_same_graph():
    v15 = _v15(
        [{"id": "a", "name": "a_ID01", "parents": [], "children": ["b"]},
         {"id": "b", "name": "b", "parents": ["a"], "children": []}],
        [{"id": "a", "runtimeInSeconds": 3.0, "coreCount": 2, "memoryInBytes": 4e9, "readBytes": 10},
         {"id": "b", "runtimeInSeconds": 5.0}],
    )
    v14 = {"schemaVersion": "1.4", "name": "w", "workflow": {"tasks": [
        {"id": "a", "name": "a_ID01", "runtimeInSeconds": 3.0, "cores": 2, "memoryInBytes": 4e9,
         "bytesRead": 10, "parents": [], "children": ["b"]},
        {"id": "b", "name": "b", "runtimeInSeconds": 5.0, "parents": ["a"]},
    ]}}
    a, b = parse_wfformat(v15, "x.json"), parse_wfformat(v14, "y.json")
    assert a.graph.tasks == b.graph.tasks and a.graph.edges == b.graph.edges == ((0, 1),)
    t = a.graph.tasks[0]
    assert (t.duration_s, t.cpus, t.memory_gb, t.kind) == (3.0, 2.0, 4.0, "a")
    assert a.read_bytes == {"a": 10.0}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"schemaVersion": "1.2", "workflow": {}}, "schemaVersion"),
        ({"schemaVersion": "1.5"}, "workflow"),
        (_v15([{"id": "a", "parents": ["zz"]}], [{"id": "a", "runtimeInSeconds": 1}]), r"tasks\[0\].parents"),
        (_v15([{"id": "a"}], [{"id": "a"}]), "runtimeInSeconds: missing"),
        (_v15([{"id": "a"}], [{"id": "a", "runtimeInSeconds": "slow"}]), "runtimeInSeconds"),
        (_v15([{"id": "a"}, {"id": "a"}], [{"id": "a", "runtimeInSeconds": 1}]), "duplicate task id"),
        (_v15([{"id": "a", "parents": ["b"]}, {"id": "b", "parents": ["a"]}],
              [{"id": "a", "runtimeInSeconds": 1}, {"id": "b", "runtimeInSeconds": 1}]), "cycle"),
        (_v15([], []), "no tasks"),
    ],
)
def test_malformed_input_names_file_and_field(doc, message, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match=message) as err:
        load_wfformat(path)
    assert str(path) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_not_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{nope")
    with pytest.raises(SchemaError, match="broken.json: not valid JSON"):
        load_wfformat(path)


# --- found by review (2026-12-06) ---


@pytest.mark.parametrize(("execution", "field"), [
    ({"runtimeInSeconds": float("nan")}, "runtimeInSeconds"),
    ({"runtimeInSeconds": float("inf")}, "runtimeInSeconds"),
    ({"runtimeInSeconds": 1, "memoryInBytes": float("nan")}, "memoryInBytes"),
    ({"runtimeInSeconds": 1, "coreCount": float("inf")}, "coreCount"),
], ids=["nan-runtime", "inf-runtime", "nan-memory", "inf-cores"])
def test_non_finite_measurements_are_refused(tmp_path: Path, execution: dict, field: str) -> None:
    """``_num`` only checks ``value < 0``, so the ``NaN``/``Infinity`` literals Python's json
    accepts (and ``1e999``, which reads as inf) pass: a NaN runtime silently becomes 0.01 s
    (``max(0.01, nan)``), an infinite one is kept and ``drl-trainer makespan`` then dies deep in
    the simulator with "OverflowError: cannot convert float infinity to integer"
    (trainer/cluster.py), and NaN memory / infinite cores reach the task graph unchecked. The
    reader should refuse them with a SchemaError naming the file and the field."""
    path = tmp_path / "nonfinite.json"
    path.write_text(json.dumps(_v15([{"id": "a"}], [{"id": "a", **execution}])))
    with pytest.raises(SchemaError, match=field) as err:
        load_wfformat(path)
    assert str(path) in str(err.value)


def test_a_number_too_large_for_a_float_is_a_schema_error() -> None:
    """An integer literal too large for a float (``runtimeInSeconds: 1000...0``, 400 digits)
    passes the type check and then ``float(value)`` raises ``OverflowError: int too large to
    convert to float``: a traceback instead of the SchemaError naming the field."""
    doc = _v15([{"id": "a"}], [{"id": "a", "runtimeInSeconds": 10**400}])
    with pytest.raises(SchemaError, match="runtimeInSeconds"):
        parse_wfformat(doc, "big.json")


def _v14(tasks: list[dict]) -> dict:
    return {"schemaVersion": "1.4", "name": "w",
            "workflow": {"makespanInSeconds": 8.0, "executedAt": "20200101T000000+0000", "tasks": tasks}}


def test_v14_dependencies_refer_to_task_names_not_ids() -> None:
    """Up to WfFormat 1.4 tasks refer to each other by *name*; only from 1.5 by id (WfFormat's own
    ``tools/wfcommons-migrate-instance.py``: "Up to version 1.4 tasks refer to each other by name
    ... and the two need not coincide"). A 1.4 instance as wfcommons 0.x wrote it (``id``
    ``ID0000001``, ``name`` ``individuals_ID0000001``, parents/children by name) is keyed here by
    ``id`` and refused: "tasks[0].children: unknown task id 'individuals_merge_ID0000002'", so
    every real 1.4 WfInstance with such ids fails to load."""
    doc = _v14([
        {"name": "individuals_ID0000001", "id": "ID0000001", "category": "individuals", "type": "compute",
         "parents": [], "children": ["individuals_merge_ID0000002"], "files": [],
         "runtimeInSeconds": 3.0, "cores": 1},
        {"name": "individuals_merge_ID0000002", "id": "ID0000002", "category": "individuals_merge",
         "type": "compute", "parents": ["individuals_ID0000001"], "children": [], "files": [],
         "runtimeInSeconds": 5.0, "cores": 1},
    ])
    trace = parse_wfformat(doc, "v14.json")
    assert trace.graph.edges == ((0, 1),)
    assert [t.kind for t in trace.graph.tasks] == ["individuals", "individuals_merge"]


def test_v14_io_volumes_are_read_from_readBytes_and_writtenBytes() -> None:
    """WfFormat 1.4 names a task's I/O ``readBytes`` / ``writtenBytes`` (what wfcommons' 1.4
    ``Task.as_dict`` writes and what the official migrator carries over to 1.5 unchanged; the
    ``bytesRead`` / ``bytesWritten`` names are 1.3's, in KB for non-Pegasus traces). The reader
    looks only for ``bytesRead`` / ``bytesWritten`` in 1.4 (wfformat.py:89), so a real 1.4 trace
    silently loses all its I/O volumes: ``read_bytes`` and ``written_bytes`` come back empty."""
    doc = _v14([
        {"name": "a", "id": "a", "parents": [], "children": ["b"], "runtimeInSeconds": 3.0,
         "cores": 1, "readBytes": 100, "writtenBytes": 200, "memoryInBytes": 2e9},
        {"name": "b", "id": "b", "parents": ["a"], "children": [], "runtimeInSeconds": 5.0},
    ])
    trace = parse_wfformat(doc, "v14.json")
    assert trace.read_bytes == {"a": 100.0}
    assert trace.written_bytes == {"a": 200.0}


def test_the_wfcommons_numeric_name_suffix_is_stripped_from_the_kind() -> None:
    """``kind`` is the task name without its ``_ID000123`` suffix, but WfCommons' other naming
    convention, ``NAME_00000001`` (``wfgen``'s ``_generate_task_name``; ``wfchef.utils._split_task_id``
    recognises both), is kept whole: every task becomes a kind of its own. The shared trace
    ``helloworld-forkjoin-10-chameleon.json`` gets 10 kinds (``cpuhog_forkjoin_00000001`` ...)
    for 10 identical tasks, so the one-hot kind feature (crc32 bucket) is noise per task and
    pool affinities never match."""
    doc = _v15([{"id": "blastall_00000002", "name": "blastall_00000002"},
                {"id": "blastall_00000003", "name": "blastall_00000003"}],
               [{"id": "blastall_00000002", "runtimeInSeconds": 1},
                {"id": "blastall_00000003", "runtimeInSeconds": 1}])
    assert [t.kind for t in parse_wfformat(doc).graph.tasks] == ["blastall", "blastall"]
    forkjoin = TRACES / "helloworld-forkjoin-10-chameleon.json"
    if forkjoin.exists():
        assert {t.kind for t in read_wfformat(forkjoin).graph.tasks} == {"cpuhog_forkjoin"}
