"""Nightly retraining of the placement policy, itself an Airflow DAG placed by DRLExecutor.

1. ``export_traces`` turns the DAG runs that ended in the last ``hours``, with their recorded
   placements (the ``drl_placement`` table, joined with what happened), into a replay file: each
   run's task graph with the durations that were observed, normalised to a speed-1 VM (a run
   still going at export time goes into the next night's file, whole).
2. ``finetune`` (``drl-trainer finetune``) starts from the active checkpoint, imitates the best
   heuristic on those replayed runs for at most ``minutes``, evaluates the candidate against the
   incumbent on held-out replayed runs in the simulator (and on the three seed families as a guard
   against forgetting), and promotes it in the model registry only if it beats the incumbent on
   the objective without losing more than 2% on the others (``--max-other-regression``, through
   ``extra_args``); policy servers hot-reload it. The
   objective trained and judged on is the registry's (``drl-policy registry activate --objective``;
   mean JCT unless one was set).
3. ``prune_traces`` deletes placements decided more than ``keep_days`` ago, and replay files as
   old, once they are exported (the table grows by one row per task try; 0 keeps everything).

The DAG is tagged ``drl-exclude``: its own runs never become training data. It needs the
``drl_traces`` connection (the database holding ``drl_placement``, usually Airflow's own) and
``DRL_REGISTRY_DIR`` on the workers (the folder the policy servers watch, shared by every worker
that may run this DAG: the two tasks can run on different workers, on different hosts). The
replay file goes to :func:`traces_dir` in that folder; the pool catalogue is the executor's
(:func:`catalogue_path`). Both paths reach ``finetune`` through ``export_traces``' XCom.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

import pendulum
from airflow.sdk import Param, dag, get_current_context, task

log = logging.getLogger(__name__)


def traces_dir() -> str:
    """Where ``export_traces`` writes the replay file that ``finetune`` reads: ``DRL_TRACES_DIR``,
    else ``<DRL_REGISTRY_DIR>/traces``. Not a local folder such as /tmp: ``finetune`` may run on
    another worker, and the registry is the volume the workers that run this DAG share."""
    explicit = os.environ.get("DRL_TRACES_DIR")
    if explicit:
        return explicit
    registry = os.environ.get("DRL_REGISTRY_DIR")
    if not registry:
        raise RuntimeError("DRL_REGISTRY_DIR is not set on this worker: set it to the model registry the "
                           "policy servers watch (or DRL_TRACES_DIR to a folder every worker shares)")
    return os.path.join(registry, "traces")


def catalogue_path() -> str:
    """The pool catalogue the executor places with, read as ``ExecutorConfig.from_conf`` reads it:
    ``[drl_executor] catalogue`` of Airflow's configuration (airflow.cfg or its
    ``AIRFLOW__DRL_EXECUTOR__CATALOGUE`` variable), else the packaged demo catalogue."""
    from airflow.configuration import conf

    from airflow_drl_executor.config import SECTION, packaged_catalogue

    return str(conf.get(SECTION, "catalogue", fallback=None) or packaged_catalogue())


def traces_engine() -> Any:
    """An engine on the ``drl_traces`` connection (the database holding ``drl_placement``)."""
    from airflow.sdk import BaseHook
    from sqlalchemy import create_engine

    uri = BaseHook.get_connection("drl_traces").get_uri()
    return create_engine(uri.replace("postgres://", "postgresql://", 1))  # SQLAlchemy's dialect name


def finetune_argv(exported: Mapping[str, str], params: Mapping[str, Any], registry: str) -> list[str]:
    """The ``drl-trainer finetune`` command line, one argument per item: no shell ever parses a
    parameter (found by review: ``params`` were rendered into a bash command, and a run triggered
    with ``{"minutes": "1; <command>"}`` ran that command on the worker, which can write the model
    registry). Numbers must read as numbers; ``extra_args`` is split as a shell would split it,
    quotes and all, but never run."""
    numbers = {"minutes": float, "min_improvement": float, "seed": int}
    for name, kind in numbers.items():
        try:
            kind(str(params[name]))
        except ValueError:
            raise ValueError(f"params.{name} must be a number, got {params[name]!r}") from None
    return ["drl-trainer", "finetune", "--replay", exported["replay"], "--registry", registry,
            "--pools", exported["pools"], "--minutes", str(params["minutes"]),
            "--min-improvement", str(params["min_improvement"]), "--seed", str(params["seed"]),
            *shlex.split(str(params["extra_args"]))]


def prune_replays(folder: str, before: dt.datetime) -> list[str]:
    """Delete the replay files in ``folder`` last written before ``before``; their names."""
    gone = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.startswith("replay-") and name.endswith(".jsonl") and os.path.getmtime(path) < before.timestamp():
                os.remove(path)
                gone.append(name)
    return gone


def _here(exported: Mapping[str, str]) -> dict[str, str]:
    """``export_traces``' XCom as files on this worker: the replay at the exporting worker's path,
    else by its name in this worker's ``traces_dir()`` (the registry mounted elsewhere); the
    catalogue must be at the same path (another one would train for pools the export did not
    use). A missing file is an error naming where it was looked for."""
    replay, name, pools = exported["replay"], exported.get("name", ""), exported["pools"]
    if not os.path.exists(replay) and name:
        mine = os.path.join(traces_dir(), name)
        if not os.path.exists(mine):
            raise FileNotFoundError(f"the exported replay is neither at {replay} (the exporting worker's path) nor "
                                    f"at {mine} (this worker's traces folder): share DRL_REGISTRY_DIR or "
                                    "DRL_TRACES_DIR between the workers")
        replay = mine
    if not os.path.exists(pools):
        raise FileNotFoundError(f"the pool catalogue the export used, {pools}, is not on this worker: give every "
                                "worker the same [drl_executor] catalogue")
    return {"replay": replay, "pools": pools}


def prune_candidates(registry: str, before: dt.datetime) -> list[str]:
    """Delete the candidate folders in ``<registry>/candidates`` last written before ``before``,
    except the ones the registry serves or may fall back to (named by ``active.json`` or
    ``last_good.json``); their names. A rollback to a pruned candidate is refused with its reason."""
    from policy.registry import ModelRegistry

    root = os.path.join(registry, "candidates")
    if not os.path.isdir(root):
        return []
    from policy.errors import CheckpointError

    try:
        keep = {os.path.realpath(path) for path in ModelRegistry(registry).named_checkpoints(strict=True)}
    except CheckpointError as exc:  # what it serves is unknown: nothing is deleted tonight
        log.warning("not pruning %s: %s", root, exc)
        return []
    gone = []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        real = os.path.realpath(folder)
        if any(k == real or k.startswith(real + os.sep) for k in keep):
            continue
        if os.path.isdir(folder) and not os.path.islink(folder) and os.path.getmtime(folder) < before.timestamp():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(name)
    return gone


@dag(
    dag_id="drl_nightly_retrain",
    schedule="0 2 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=True,  # an operator turns retraining on deliberately
    tags=["drl", "drl-exclude"],
    # extra_args: more drl-trainer finetune flags (e.g. a small evaluation for a smoke test)
    # hours: at most 31 days (the export holds the window's placements in memory, ~1.5 KB each)
    params={"hours": Param(24, type="number", exclusiveMinimum=0, maximum=744),
            "minutes": Param(10, type="number", exclusiveMinimum=0),
            "min_improvement": Param(0.01, type="number"), "seed": Param(1, type="integer"),
            "extra_args": Param("", type="string"), "keep_days": Param(90, type="number", minimum=0)},
)
def drl_nightly_retrain() -> None:
    # one XCom, the dict: finetune's template reads its keys
    @task(executor_config={"drl": {"duration_s": 30, "cpus": 1, "memory_gb": 2}}, multiple_outputs=False)
    def export_traces() -> dict[str, str]:
        from sqlalchemy.orm import Session

        from airflow_drl_executor.export import export_runs
        from policy.catalogue import load_catalogue
        from policy.replay import write_replay

        ctx = get_current_context()
        until = ctx.get("data_interval_end") or dt.datetime.now(dt.UTC)  # manual runs have none
        since = until - dt.timedelta(hours=float(ctx["params"]["hours"]))
        from airflow.configuration import conf

        from airflow_drl_executor.config import SECTION

        pools = catalogue_path()
        catalogue = load_catalogue(pools)
        engine = traces_engine()
        try:
            with Session(engine) as session:  # a never-placed task as the executor would send it
                runs = export_runs(session, catalogue, since=since, until=until,
                                   default_queue=str(conf.get("operators", "default_queue", fallback="default")),
                                   default_duration_s=conf.getfloat(SECTION, "default_duration_s", fallback=60.0))
        finally:
            engine.dispose()
        folder = traces_dir()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"replay-{until:%Y%m%dT%H%M%S}.jsonl")
        n = write_replay(path, runs)
        from policy.registry import share_tree

        share_tree(folder, recursive=False)  # the group's (a fine-tune or prune of another user reads them)
        share_tree(path)
        print(f"exported {n} DAG runs ({since} .. {until}) to {path}")
        # its path here and its name: finetune reads the path, or the name in its own traces_dir()
        # where its worker mounts the registry elsewhere (found by review)
        return {"replay": os.path.abspath(path), "name": os.path.basename(path), "pools": pools}

    @task(executor_config={"drl": {"duration_s": 600, "cpus": 4, "memory_gb": 8, "kind": "gpu_train"}})
    def finetune(exported: dict[str, str]) -> None:
        registry = os.environ.get("DRL_REGISTRY_DIR")
        if not registry:
            raise RuntimeError("DRL_REGISTRY_DIR is not set on this worker: set it to the model registry the "
                               "policy servers watch")
        argv = finetune_argv(_here(exported), get_current_context()["params"], registry)
        print("running:", shlex.join(argv), flush=True)
        subprocess.run(argv, check=True)  # its output goes to the task's log
    # all_done: a failed export (a catalogue that does not match) must not stop the pruning
    @task(executor_config={"drl": {"duration_s": 30, "cpus": 1, "memory_gb": 2}}, trigger_rule="all_done")
    def prune_traces() -> None:
        from airflow_drl_executor import traces

        keep_days = float(get_current_context()["params"]["keep_days"])
        if keep_days <= 0:
            print("keep_days is 0: every placement and replay file is kept")
            return
        before = dt.datetime.now(dt.UTC) - dt.timedelta(days=keep_days)
        engine = traces_engine()
        try:
            deleted = traces.prune(engine, before)
        finally:
            engine.dispose()
        gone = prune_replays(traces_dir(), before)
        registry = os.environ.get("DRL_REGISTRY_DIR")
        candidates = prune_candidates(registry, before) if registry else []
        print(f"pruned {deleted} placements, {len(gone)} replay files and {len(candidates)} candidates (not the "
              f"active or last good one) from before {before:%Y-%m-%d %H:%M}")

    exported = export_traces()
    finetune(exported)
    exported >> prune_traces()


drl_nightly_retrain()
