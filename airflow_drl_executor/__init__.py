"""airflow-drl-executor: an Airflow executor that learns where to run each task.

``executor = DRLExecutor:airflow_drl_executor.DRLExecutor`` in airflow.cfg. The executor class is
imported lazily so that importing the package (provider discovery, plugins) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_drl_executor.executor import DRLExecutor

__all__ = ["DRLExecutor"]


def __getattr__(name: str) -> Any:
    if name == "DRLExecutor":
        from airflow_drl_executor.executor import DRLExecutor

        return DRLExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
