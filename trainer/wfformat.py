"""Import of WfCommons WfFormat 1.4 / 1.5 / 1.6 workflow instances as :class:`~policy.schema.RunGraph`.

WfFormat 1.5 splits a workflow into ``workflow.specification.tasks`` (``id``, ``name``,
``parents``, ``children``) and ``workflow.execution.tasks`` (``id``, ``runtimeInSeconds``,
``coreCount``, ``avgCPU``, ``memoryInBytes``, ``readBytes``, ``writtenBytes``); 1.4 keeps one list,
``workflow.tasks``, with the measurements inline (``runtimeInSeconds``, ``cores``,
``memoryInBytes``, ``readBytes``/``writtenBytes``; 1.3's ``bytesRead``/``bytesWritten`` are read
where those are absent), and its tasks name their parents and children by ``name``, not ``id``
(WfFormat's own migration tool says so; an ``id`` is taken where no name matches). The JSON is parsed here, offline (the
``wfcommons`` loader fetches its schema from the network). Malformed input raises
:class:`~policy.errors.SchemaError` (a ``ValueError``) naming the file and the field.

Mapping to the task graph: ``duration_s`` = measured runtime (at least 0.01 s), ``cpus`` = cores
(default 1), ``memory_gb`` = peak memory in GB (default 1), ``kind`` = the task's ``name`` without
its ``_ID000123`` or ``_00000001`` suffix (WfCommons' two conventions; e.g. ``blastall``),
``priority`` = the trace's ``priority`` if given. Measurements must be finite numbers >= 0.

(The Epigenomics traces name each task after its input files, e.g.
``fast2bfq_fast2bfq_HEP2_MSP1_Digests_s_1_sequence_1_ID0000002``, so each of their tasks is a
kind of its own; their ``command.program`` says ``fast2bfq``. It is not used: those traces are the
held-out family every committed figure was measured on, with these kinds.)
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from policy.errors import SchemaError
from policy.schema import RunGraph, TaskNode

SUPPORTED = ("1.4", "1.5", "1.6")  # 1.6: what wfcommons 1.6 writes (same task layout as 1.5)
_ID_SUFFIX = re.compile(r"_(?:ID\d+|\d{8})$")


@dataclass(frozen=True)
class WfTrace:
    """A workflow instance: its task graph plus the I/O volumes the graph has no field for."""

    graph: RunGraph
    read_bytes: Mapping[str, float] = field(default_factory=dict)
    written_bytes: Mapping[str, float] = field(default_factory=dict)
    name: str = ""


def _num(obj: Mapping[str, Any], key: str, where: str, default: float | None) -> float | None:
    value = obj.get(key)
    if value is None:
        return default
    try:
        # found by review: NaN and Infinity (json reads both, and 1e999 as inf) passed the check: a
        # NaN runtime became 0.01 s, an infinite one ended the simulator in an OverflowError
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        number = math.nan
    if not math.isfinite(number) or number < 0:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise SchemaError(f"{where}.{key}: expected a finite number >= 0, got {shown}")
    return number


def _ids(obj: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchemaError(f"{where}.{key}: expected a list of task ids, got {value!r}")
    return value


def _unicode(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (JSON's escapes can make lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_wfformat(doc: Any, source: str = "<memory>") -> WfTrace:
    """Build a :class:`WfTrace` from a decoded WfFormat document."""
    if not isinstance(doc, Mapping):
        raise SchemaError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    version = doc.get("schemaVersion")
    if str(version) not in SUPPORTED:
        raise SchemaError(f"{source}: schemaVersion: {version!r} not supported (want one of {SUPPORTED})")
    wf = doc.get("workflow")
    if not isinstance(wf, Mapping):
        raise SchemaError(f"{source}: workflow: missing or not an object")
    spec_where = f"{source}: workflow.specification.tasks"
    if str(version) != "1.4":  # the layout the version says (found by review: a 1.5 file without its
        # specification was read as 1.4 and refused for a workflow.tasks it must not have)
        spec = wf.get("specification")
        if not isinstance(spec, Mapping):
            raise SchemaError(f"{source}: workflow.specification: missing or not an object"
                              f" (schemaVersion {version} keeps its tasks there)")
        if not isinstance(spec.get("tasks"), list):
            raise SchemaError(f"{spec_where}: missing or not a list")
        spec_tasks: list[Any] = spec["tasks"]
        execution = wf.get("execution") or {}
        if not isinstance(execution, Mapping) or not isinstance(execution.get("tasks", []), list):
            raise SchemaError(f"{source}: workflow.execution.tasks: not a list")
        measured: dict[str, Mapping[str, Any]] = {}
        for i, t in enumerate(execution.get("tasks", [])):
            where = f"{source}: workflow.execution.tasks[{i}]"
            if not isinstance(t, Mapping) or not isinstance(t.get("id"), str):
                raise SchemaError(f"{where}.id: missing or not a string")
            if t["id"] in measured:  # found by review: the last one was kept, by the file's order
                raise SchemaError(f"{where}.id: duplicate execution record of task {t['id']!r}")
            measured[t["id"]] = t
        read_keys: tuple[str, ...] = ("readBytes",)
        written_keys: tuple[str, ...] = ("writtenBytes",)
        cores_key = "coreCount"
        by_name = False
    else:
        spec_where = f"{source}: workflow.tasks"
        if not isinstance(wf.get("tasks"), list):
            raise SchemaError(f"{spec_where}: missing or not a list")
        spec_tasks = wf["tasks"]
        measured = {}
        # found by review: 1.4's names are 1.5's; bytesRead / bytesWritten are 1.3's (all I/O was lost)
        read_keys, written_keys, cores_key = ("readBytes", "bytesRead"), ("writtenBytes", "bytesWritten"), "cores"
        by_name = True  # found by review: 1.4 tasks name each other by name (every id-keyed 1.4 trace was refused)
    if not spec_tasks:
        raise SchemaError(f"{spec_where}: the workflow has no tasks")
    ids: list[str] = []
    for i, t in enumerate(spec_tasks):
        where = f"{spec_where}[{i}]"
        if not isinstance(t, Mapping):
            raise SchemaError(f"{where}: expected an object")
        tid = t.get("id", t.get("name"))
        if not isinstance(tid, str) or not tid:
            raise SchemaError(f"{where}.id: missing or not a string")
        for key, text in (("id", tid), ("name", t.get("name"))):
            if isinstance(text, str) and not _unicode(text):  # found by review: a lone surrogate
                # ("\udc00") was read, and featurisation died far from here on its encode()
                raise SchemaError(f"{where}.{key}: {text!r} is not valid Unicode")
        ids.append(tid)
    index = {tid: i for i, tid in enumerate(ids)}
    if len(index) != len(ids):
        dup = next(t for t in ids if ids.count(t) > 1)
        raise SchemaError(f"{spec_where}: duplicate task id {dup!r}")
    unknown = sorted(set(measured) - set(index))
    if unknown:  # found by review: a typo's measurement was dropped without a word
        raise SchemaError(f"{source}: workflow.execution.tasks: no specification task has the id {unknown[0]!r}"
                          f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}")
    ambiguous: set[str] = set()
    if by_name:  # a reference is a name first, then an id (as WfFormat's migration tool resolves them)
        names = {t["name"]: i for i, t in reversed(list(enumerate(spec_tasks))) if isinstance(t.get("name"), str)}
        counts = Counter(t["name"] for t in spec_tasks if isinstance(t.get("name"), str))
        ambiguous = {n for n, c in counts.items() if c > 1}  # refused once a task names one of them
        index = {**index, **names}
    tasks: list[TaskNode] = []
    edges: set[tuple[int, int]] = set()
    read: dict[str, float] = {}
    written: dict[str, float] = {}
    for i, t in enumerate(spec_tasks):
        where = f"{spec_where}[{i}]"
        tid = ids[i]
        m = measured.get(tid, t)
        mwhere = f"{source}: workflow.execution.tasks[id={tid}]" if tid in measured else where
        runtime = _num(m, "runtimeInSeconds", mwhere, None)
        if runtime is None:
            raise SchemaError(f"{mwhere}.runtimeInSeconds: missing")
        cores = _num(m, cores_key, mwhere, 1.0) or 1.0
        mem = _num(m, "memoryInBytes", mwhere, None)
        prio = _num(m, "priority", mwhere, 1.0)
        name = t.get("name") if isinstance(t.get("name"), str) else tid
        tasks.append(TaskNode(
            task_id=tid, duration_s=max(0.01, runtime), cpus=cores,
            memory_gb=(mem / 1e9 if mem else 1.0), priority=prio if prio is not None else 1.0,
            kind=_ID_SUFFIX.sub("", name) or "default",
        ))
        for keys, out in ((read_keys, read), (written_keys, written)):
            key = next((k for k in keys if m.get(k) is not None), keys[0])
            v = _num(m, key, mwhere, None)
            if v is not None:
                out[tid] = v
        for ref in (*_ids(t, "parents", where), *_ids(t, "children", where)):
            if ref in ambiguous:  # found by review: read as the first task of that name, a wrong DAG
                raise SchemaError(f"{where}: the duplicate task name {ref!r} (shared by"
                                  f" {sum(1 for u in spec_tasks if u.get('name') == ref)} tasks) is ambiguous")
        for parent in _ids(t, "parents", where):
            if parent not in index:
                raise SchemaError(f"{where}.parents: unknown task {'name' if by_name else 'id'} {parent!r}")
            edges.add((index[parent], i))
        for child in _ids(t, "children", where):
            if child not in index:
                raise SchemaError(f"{where}.children: unknown task {'name' if by_name else 'id'} {child!r}")
            edges.add((i, index[child]))
    run_key = str(doc.get("name") or Path(source).stem)
    try:
        graph = RunGraph(run_key=run_key, tasks=tuple(tasks), edges=tuple(sorted(edges)))
    except SchemaError as exc:
        raise SchemaError(f"{source}: {exc}") from exc
    from policy.graph import view

    try:
        view(graph)
    except SchemaError as exc:
        raise SchemaError(f"{source}: workflow tasks: {exc}") from exc
    return WfTrace(graph=graph, read_bytes=read, written_bytes=written, name=run_key)


def read_wfformat(path: str | Path) -> WfTrace:
    """Read one WfFormat JSON file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())  # UTF-8 (or -16/-32) whatever the locale
    except OSError as exc:
        raise SchemaError(f"{path}: cannot read: {exc}") from exc
    except ValueError as exc:
        raise SchemaError(f"{path}: not valid JSON: {exc}") from exc
    trace = parse_wfformat(doc, str(path))
    # Files are the identity of a trace: key runs by file stem, not by the trace's own name.
    graph = RunGraph(run_key=path.stem, tasks=trace.graph.tasks, edges=trace.graph.edges)
    return WfTrace(graph=graph, read_bytes=trace.read_bytes, written_bytes=trace.written_bytes,
                   name=trace.name)


def load_wfformat(path: str | Path) -> RunGraph:
    """Read one WfFormat JSON file as a :class:`RunGraph` keyed by the file's stem."""
    return read_wfformat(path).graph
