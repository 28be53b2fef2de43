"""Synthetic workflow instances from the WfCommons recipes (``wfcommons`` 1.6), offline.

A spec ``wfcommons:RECIPE:TASKS[:COUNT]`` (e.g. ``wfcommons:epigenomics:200:4``) generates
``COUNT`` (default 4) instances of about ``TASKS`` tasks with WfChef's recipe for that family
(Coleman et al., "WfChef", 2021), seeded from the caller's generator, and imports each through the
same WfFormat reader as the real traces. The recipes carry their statistics inside the package,
so nothing is fetched; ``wfcommons`` is imported only here, only when such a spec is used.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import numpy as np

from policy.schema import RunGraph

PREFIX = "wfcommons:"

#: recipe name -> class name in ``wfcommons.wfchef.recipes``
RECIPES = {
    "blast": "BlastRecipe", "bwa": "BwaRecipe", "cycles": "CyclesRecipe", "epigenomics": "EpigenomicsRecipe",
    "genome": "GenomeRecipe", "montage": "MontageRecipe", "rnaseq": "RnaseqRecipe",
    "seismology": "SeismologyRecipe", "soykb": "SoykbRecipe", "srasearch": "SrasearchRecipe",
}


def parse_spec(spec: str) -> tuple[str, int, int]:
    """``wfcommons:RECIPE:TASKS[:COUNT]`` -> (recipe, tasks, count); ValueError naming the part."""
    parts = spec[len(PREFIX):].split(":") if spec.startswith(PREFIX) else []
    if len(parts) not in (2, 3):
        raise ValueError(f"{spec!r}: expected wfcommons:RECIPE:TASKS[:COUNT]")
    recipe = parts[0]
    if recipe not in RECIPES:
        raise ValueError(f"{spec!r}: unknown recipe {recipe!r}; one of {sorted(RECIPES)}")
    try:
        tasks, count = int(parts[1]), int(parts[2]) if len(parts) == 3 else 4
    except ValueError as exc:
        raise ValueError(f"{spec!r}: TASKS and COUNT must be integers") from exc
    if tasks < 2 or count < 1:
        raise ValueError(f"{spec!r}: need TASKS >= 2 and COUNT >= 1")
    return recipe, tasks, count


def generate(spec: str, rng: np.random.Generator) -> list[RunGraph]:
    """The instances a ``wfcommons:...`` spec names, as run graphs keyed ``RECIPE-TASKS-i``."""
    from wfcommons import WorkflowGenerator
    from wfcommons.wfchef import recipes

    from trainer.wfformat import load_wfformat

    recipe, tasks, count = parse_spec(spec)
    cls = getattr(recipes, RECIPES[recipe])
    out: list[RunGraph] = []
    with tempfile.TemporaryDirectory(prefix="drl-wfchef-") as tmp:
        for i in range(count):
            seed = int(rng.integers(2**31 - 1))
            # WfChef draws from the global generators; seed both for repeatable instances.
            random.seed(seed)
            np.random.seed(seed % (2**32 - 1))
            try:
                workflow = WorkflowGenerator(cls.from_num_tasks(tasks)).build_workflow()
            except ValueError as exc:  # e.g. fewer tasks than the recipe's smallest base graph
                raise ValueError(f"{spec!r}: {exc}") from exc
            path = Path(tmp) / f"{recipe}-{tasks}-{i}.json"
            workflow.write_json(path)
            doc = json.loads(path.read_text())
            if not doc.get("workflow", {}).get("specification", {}).get("tasks"):
                raise ValueError(f"{spec!r}: the {recipe} recipe produced an empty workflow")
            out.append(load_wfformat(path))
    return out
