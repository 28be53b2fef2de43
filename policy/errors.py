"""Domain exceptions of the placement layer, in one place (as rq does)."""

from __future__ import annotations


class PolicyError(Exception):
    """Base class of every error raised by the placement layer."""


class SchemaError(PolicyError, ValueError):
    """A message or file does not match the wire schema; the message names the field."""


class ReplayError(SchemaError):
    """A replay file (recorded DAG runs) is malformed; the message names the file and the line."""


class WorkloadError(PolicyError, ValueError):
    """A workload spec (``drl-trainer --workflows``) names nothing usable; the message names the part."""


class CatalogueError(PolicyError, ValueError):
    """A pool catalogue file is malformed; the message names the file and the field."""


class NoFeasiblePool(PolicyError):
    """No pool can run a task under its hard constraints (resources, pinning, pools down)."""


class CheckpointError(PolicyError):
    """A checkpoint or registry manifest is missing, tampered with or does not match the code."""


class ModelOutputError(PolicyError):
    """The model's output for a request is not finite (an input far outside what it was trained
    on, e.g. a price of 1e308/h); the arbiter then places that request by the fallback heuristic."""
