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
