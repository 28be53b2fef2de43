"""The sample retry DAG after a clear: its first try since the clear fails, as its docstring says
(found by review: Airflow 3 never lowers try_number at a clear, so a cleared run never failed)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[2] / "dags"


def _dag_module(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"sample_{name}", DAGS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cleared_retry_batch_run_still_fails_its_first_try_and_retries() -> None:
    """``dags/retry_batch.py`` says ``fetch`` fails its first try and succeeds on its retry, which
    reaches DRLExecutor "as a retry (``try_number`` 2 since the last clear)". But ``fetch`` fails
    only when Airflow's absolute ``try_number`` is 1: Airflow 3 never lowers ``try_number`` at a
    clear (a clear sets ``max_tries`` to the try number then plus ``retries``, and the next try is
    numbered 3). A user who clears a finished run to watch the retry placement again sees ``fetch``
    succeed at once on its first try since the clear: no failure, no retry, nothing for the
    executor's retry path. Expected: the first try since the last clear fails (here try 3 with
    ``max_tries`` 3 and ``retries`` 1), and its retry (try 4) succeeds."""
    mod = _dag_module("retry_batch")
    fetch = mod.retry_batch().get_task("fetch")
    assert fetch.retries == 1

    def ti(try_number: int, max_tries: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(try_number=try_number, max_tries=max_tries,
                                     task=types.SimpleNamespace(retries=fetch.retries))

    # the first run: try 1 fails, its retry (try 2) succeeds (max_tries = retries = 1)
    with pytest.raises(RuntimeError, match=mod.FIRST_TRY_FAILS):
        fetch.python_callable(ti=ti(1, 1))
    assert fetch.python_callable(ti=ti(2, 1)) == 42
    # cleared after it succeeded at try 2: max_tries = 2 + 1; the first try since the clear is try 3
    with pytest.raises(RuntimeError, match=mod.FIRST_TRY_FAILS):
        fetch.python_callable(ti=ti(3, 3))
    assert fetch.python_callable(ti=ti(4, 3)) == 42
