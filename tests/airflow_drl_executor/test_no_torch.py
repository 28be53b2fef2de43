"""The Airflow side stays free of torch (the scheduler's image installs none): importing every
module of the package, the executor, the UI plugin and the CLI command among them, imports no torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import airflow_drl_executor


def test_no_module_of_the_airflow_side_imports_torch() -> None:
    names = sorted(f"airflow_drl_executor.{m.name}" for m in pkgutil.iter_modules(airflow_drl_executor.__path__))
    assert {"airflow_drl_executor.executor", "airflow_drl_executor.plugin", "airflow_drl_executor.check"} <= set(names)
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torch_geometric'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
