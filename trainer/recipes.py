"""Synthetic workflow instances from the WfCommons recipes (``wfcommons`` 1.6), offline.

A spec ``wfcommons:RECIPE:TASKS[:COUNT]`` (e.g. ``wfcommons:epigenomics:200:4``) generates
``COUNT`` (default 4) instances of about ``TASKS`` tasks with WfChef's recipe for that family
(Coleman et al., "WfChef", 2021), seeded from the caller's generator (in a child process whose
string hashing is fixed: same seed, same instances in every process), and imports each through
the same WfFormat reader as the real traces. The recipes carry their statistics inside the
package, so nothing is fetched; ``wfcommons`` is imported only here, only when such a spec is used.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from policy.errors import WorkloadError
from policy.schema import MAX_TASKS_PER_RUN, RunGraph

PREFIX = "wfcommons:"
#: ``PYTHONHASHSEED`` of the process that builds the instances (see :func:`generate`)
HASH_SEED = "0"
#: the most instances one ``wfcommons:`` spec may ask for
MAX_COUNT = 1000

#: recipe name -> class name in ``wfcommons.wfchef.recipes``
RECIPES = {
    "blast": "BlastRecipe", "bwa": "BwaRecipe", "cycles": "CyclesRecipe", "epigenomics": "EpigenomicsRecipe",
    "genome": "GenomeRecipe", "montage": "MontageRecipe", "rnaseq": "RnaseqRecipe",
    "seismology": "SeismologyRecipe", "soykb": "SoykbRecipe", "srasearch": "SrasearchRecipe",
}


def parse_spec(spec: str) -> tuple[str, int, int]:
    """``wfcommons:RECIPE:TASKS[:COUNT]`` -> (recipe, tasks, count); :class:`WorkloadError` (a
    ``ValueError``) naming the part. TASKS is at most what one run may hold
    (:data:`~policy.schema.MAX_TASKS_PER_RUN`), COUNT at most :data:`MAX_COUNT`."""
    parts = spec[len(PREFIX):].split(":") if spec.startswith(PREFIX) else []
    if len(parts) not in (2, 3):
        raise WorkloadError(f"{spec!r}: expected wfcommons:RECIPE:TASKS[:COUNT]")
    recipe = parts[0]
    if recipe not in RECIPES:
        raise WorkloadError(f"{spec!r}: unknown recipe {recipe!r}; one of {sorted(RECIPES)}")
    try:
        tasks, count = int(parts[1]), int(parts[2]) if len(parts) == 3 else 4
    except ValueError as exc:
        raise WorkloadError(f"{spec!r}: TASKS and COUNT must be integers") from exc
    if not (2 <= tasks <= MAX_TASKS_PER_RUN and 1 <= count <= MAX_COUNT):
        # found by review: no upper bound, so a typo (an extra 0) had WfChef build for hours a run
        # larger than any server takes
        raise WorkloadError(f"{spec!r}: need 2 <= TASKS <= {MAX_TASKS_PER_RUN} and 1 <= COUNT <= {MAX_COUNT}")
    return recipe, tasks, count


def generate(spec: str, rng: np.random.Generator) -> list[RunGraph]:
    """The instances a ``wfcommons:...`` spec names, as run graphs keyed ``RECIPE-TASKS-i``.

    WfChef builds them in a child process with ``PYTHONHASHSEED`` fixed (:data:`HASH_SEED`): it
    iterates over sets of task names, whose order follows Python's per-process string hashing, so
    the same seeds gave different instances in different processes (a benchmark's rows and its
    baselines, run apart, compared different workflows). Same seed, same instances, in any process.
    """
    from trainer.wfformat import load_wfformat

    recipe, tasks, count = parse_spec(spec)
    seeds = [int(rng.integers(2**31 - 1)) for _ in range(count)]
    with tempfile.TemporaryDirectory(prefix="drl-wfchef-") as tmp:
        env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
        cmd = [sys.executable, "-c", "import sys; from trainer.recipes import _build; _build(sys.argv[1:])",
               recipe, str(tasks), tmp, *map(str, seeds)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        error = Path(tmp) / "error.txt"
        if error.exists():
            raise WorkloadError(f"{spec!r}: {error.read_text()}")
        if done.returncode != 0:
            raise RuntimeError(f"{spec!r}: the WfChef generator failed (exit {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        return [load_wfformat(Path(tmp) / f"{recipe}-{tasks}-{i}.json") for i in range(count)]


def _build(argv: list[str]) -> None:
    """The child of :func:`generate`: ``RECIPE TASKS FOLDER SEED...`` -> one WfFormat file per
    seed in FOLDER (``RECIPE-TASKS-i.json``), or FOLDER/error.txt for a recipe's ValueError."""
    from wfcommons import WorkflowGenerator
    from wfcommons.wfchef import recipes

    recipe, tasks, folder, seeds = argv[0], int(argv[1]), Path(argv[2]), [int(s) for s in argv[3:]]
    cls = getattr(recipes, RECIPES[recipe])
    for i, seed in enumerate(seeds):
        # WfChef draws from the global generators; seed both for repeatable instances.
        random.seed(seed)
        np.random.seed(seed % (2**32 - 1))
        try:
            workflow = WorkflowGenerator(cls.from_num_tasks(tasks)).build_workflow()
        except ValueError as exc:  # e.g. fewer tasks than the recipe's smallest base graph
            (folder / "error.txt").write_text(str(exc))
            return
        path = folder / f"{recipe}-{tasks}-{i}.json"
        workflow.write_json(path)
        doc = json.loads(path.read_text())
        if not doc.get("workflow", {}).get("specification", {}).get("tasks"):
            (folder / "error.txt").write_text(f"the {recipe} recipe produced an empty workflow")
            return
