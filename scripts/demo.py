"""Run the sample DAGs through DRLExecutor on the local stack and print where every task ran.

    python scripts/demo.py            # triggers, waits, prints the table, keeps the stack up
    python scripts/demo.py --once     # stops the stack after the runs; exit 0 only if every run
                                      # succeeded and every task ran on a worker of its chosen pool

Talks to the stack started by ``scripts/localstack.py up`` (same ``DRL_STACK_DIR`` and ports):
Airflow's REST API for triggering and waiting, the metadata database for the placements.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localstack import VENV_BIN, Stack, from_env  # noqa: E402

DEMO_DAGS = ("drl_etl_fanout", "drl_ml_pipeline")


class DemoError(RuntimeError):
    pass


@dataclass
class Api:
    """A minimal client of Airflow's public REST API (JWT from the simple auth manager)."""

    base: str
    token: str = ""

    @classmethod
    def login(cls, stack: Stack, timeout: float = 60.0) -> Api:
        api = cls(stack.api_url)
        body = {"username": "admin", "password": stack.secret("admin")}
        end = time.monotonic() + timeout
        while True:
            try:
                api.token = api.call("POST", "/auth/token", body, auth=False)["access_token"]
                return api
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > end:
                    raise DemoError(f"cannot log in to {api.base}: {exc}") from exc
                time.sleep(1)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, *, auth: bool = True) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if auth:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=30) as resp:
            payload = resp.read()
        return json.loads(payload) if payload else None

    def wait_dag(self, dag_id: str, timeout: float = 180.0) -> None:
        """Wait until the dag-processor has parsed ``dag_id``; unpause it."""
        end = time.monotonic() + timeout
        while True:
            try:
                self.call("GET", f"/api/v2/dags/{dag_id}")
                self.call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 404 or time.monotonic() > end:
                    raise DemoError(f"DAG {dag_id} not available: HTTP {exc.code}") from exc
                time.sleep(1)

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        run = self.call("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
        return str(run["dag_run_id"])

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 300.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            state = self.call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return str(state)
            time.sleep(1)
        raise DemoError(f"{dag_id}/{run_id} not finished after {timeout:.0f}s")


def placements(stack: Stack, runs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every placement of these runs joined with its outcome (latest try per task)."""
    from sqlalchemy import create_engine

    from airflow_drl_executor import traces

    engine = create_engine(stack.sql_conn)
    wanted = set(runs)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(traces.outcomes_query(10_000))]
    engine.dispose()
    rows = [r for r in rows if (r["dag_id"], r["run_id"]) in wanted]
    rows.sort(key=lambda r: (r["dag_id"], r["start_date"] or r["decided_at"], r["task_id"]))
    return rows


def ran_on_chosen_pool(row: dict[str, Any]) -> bool:
    return str(row.get("hostname") or "").split("@", 1)[0] == row["pool"]


def table(rows: list[dict[str, Any]]) -> str:
    def ts(v: Any) -> str:
        return v.strftime("%H:%M:%S.%f")[:-3] if v is not None else "-"

    lines = [f"{'dag':<16} {'task':<26} {'pool':<9} {'vm class':<9} {'state':<8} {'start':<12} {'end':<12} "
             f"{'worker':<14} reason"]
    for r in rows:
        reason = r["reason"] if len(r["reason"]) <= 90 else r["reason"][:87] + "..."
        lines.append(
            f"{r['dag_id'][:16]:<16} {r['task_id'][:26]:<26} {r['pool']:<9} {r['vm_class']:<9} "
            f"{str(r['state']):<8} {ts(r['start_date']):<12} {ts(r['end_date']):<12} "
            f"{str(r['hostname'] or '-').split('.')[0][:14]:<14} {'[fallback] ' if r['fallback'] else ''}{reason}"
        )
    return "\n".join(lines)


def deployment_check(stack: Stack, output: str = "text") -> subprocess.CompletedProcess[str]:
    """``airflow drl-executor check`` with the stack's scheduler environment."""
    return subprocess.run([str(VENV_BIN / "airflow"), "drl-executor", "check", "--output", output],
                          env=stack.airflow_env(), capture_output=True, text=True, timeout=120, check=False)


def run_demo(stack: Stack, dags: tuple[str, ...] = DEMO_DAGS, timeout: float = 300.0) -> tuple[bool, str]:
    checked = deployment_check(stack)
    print("[demo] airflow drl-executor check:", flush=True)
    print("\n".join(f"  {line}" for line in checked.stdout.splitlines() if line.strip()), flush=True)
    api = Api.login(stack)
    for dag_id in dags:
        api.wait_dag(dag_id)
    started = [(dag_id, api.trigger(dag_id)) for dag_id in dags]
    print(f"[demo] triggered {', '.join(f'{d}/{r}' for d, r in started)}", flush=True)
    states = {(d, r): api.wait_run(d, r, timeout) for d, r in started}
    time.sleep(1.0)  # let the last outcomes land in task_instance_history
    rows = placements(stack, started)
    ok = all(s == "success" for s in states.values()) and bool(rows)
    wrong = [r for r in rows if not ran_on_chosen_pool(r)]
    report = [table(rows), ""]
    for (d, r), s in states.items():
        report.append(f"[demo] {d}/{r}: {s}")
    report.append(f"[demo] {len(rows)} placements, {sum(bool(r['fallback']) for r in rows)} fallback, "
                  f"{len(wrong)} ran elsewhere than placed")
    return ok and not wrong, "\n".join(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--once", action="store_true", help="exit after the runs (status 0 only if all succeeded)")
    args = parser.parse_args(argv)
    stack = from_env()
    try:
        ok, report = run_demo(stack)
    except DemoError as exc:
        print(f"[demo] error: {exc}; logs in {stack.logs}", file=sys.stderr)
        if args.once:
            stack.down()
        return 1
    except BaseException:  # Ctrl-C or an unexpected error while waiting: the services run in sessions
        print("\n[demo] stopping the stack", file=sys.stderr)  # of their own, so nothing else stops them
        stack.down()
        raise
    print(report)
    print(f"\n[demo] Airflow UI: {stack.api_url}  login: admin / {stack.secret('admin')}")
    print(f"[demo] placements page: {stack.api_url}/drl/   policy metrics: http://127.0.0.1:{stack.ports.metrics}/metrics")
    if args.once:
        stack.down()
        return 0 if ok else 1
    print("[demo] the stack keeps running; Ctrl-C stops everything", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\n[demo] stopping the stack")
        stack.down()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
