"""Replay files: recorded DAG runs, as the simulator replays them and the fine-tuner learns from.

One JSON object per line: ``{"arrival_s": 12.5, "graph": <RunGraph JSON>, "source": "..."}``.
Durations in the graph are normalised to a VM of relative speed 1.0 (the observed run time times
the effective speed of the pool that ran the task), so a replay can place tasks anywhere.
Written by the Airflow side (``airflow_drl_executor.export``), read by the trainer; both import
this module, which imports neither torch nor Airflow.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from policy.errors import ReplayError, SchemaError
from policy.graph import check_dag
from policy.schema import RunGraph


@dataclass(frozen=True)
class ReplayRun:
    """One recorded DAG run: its task graph and when it arrived (seconds after the first run)."""

    graph: RunGraph
    arrival_s: float
    source: str = ""

    def to_json(self) -> dict[str, object]:
        return {"arrival_s": self.arrival_s, "graph": self.graph.to_json(), "source": self.source}


def write_replay(path: str | Path, runs: Iterable[ReplayRun]) -> int:
    """Write ``runs`` as JSON lines; returns how many were written."""
    n = 0
    with open(path, "w") as fh:
        for run in runs:
            fh.write(json.dumps(run.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_replay(path: str | Path) -> list[ReplayRun]:
    """Read a replay file; a malformed line raises :class:`SchemaError` naming the file and line."""
    out: list[ReplayRun] = []
    try:
        fh = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:  # found by review: a missing file or a folder was a traceback
        raise ReplayError(f"{path}: cannot read the replay file: {exc.strerror or exc}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ReplayError(f"{where}: not JSON: {exc}") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("graph"), dict):
                raise ReplayError(f"{where}: expected {{arrival_s, graph}}")
            arrival = obj.get("arrival_s", 0.0)
            # found by review: NaN and Infinity (json reads both) passed "arrival < 0", and the
            # simulator refused the run later without naming the file
            if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < math.inf:
                raise ReplayError(f"{where}.arrival_s: expected a finite number >= 0, got {arrival!r}")
            try:
                graph = RunGraph.from_json(obj["graph"], where)
                check_dag(graph)  # found by review: a cycle stopped the fine-tune inside its simulator
            except SchemaError as exc:
                raise ReplayError(f"{where}: {exc}" if where not in str(exc) else str(exc)) from exc
            out.append(ReplayRun(graph, float(arrival), str(obj.get("source", ""))))
    out.sort(key=lambda r: r.arrival_s)
    return out
