"""The container deployment agrees with the code: queues, commands, files.

(No Docker engine runs on the development machines; these checks keep docker-compose.yaml honest.)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
import yaml

from policy import server
from policy.catalogue import load_catalogue

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yaml").read_text())


def test_one_worker_per_demo_pool() -> None:
    pools = set(load_catalogue(REPO / "policy/catalogues/demo.yaml").names)
    queues = set()
    for name, svc in COMPOSE["services"].items():
        cmd = svc.get("command", [])
        if cmd[:3] == ["airflow", "celery", "worker"]:
            queue = cmd[cmd.index("-q") + 1]
            queues.add(queue)
            assert svc["environment"]["DRL_WORKER_NAME"].startswith(f"{queue}@"), name
    assert queues == pools


def test_policy_server_command_parses() -> None:
    cmd = COMPOSE["services"]["policy-server"]["command"]
    assert cmd[0] == "serve"
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args([re.sub(r"\$\{[^}]*\}", "pw", a) for a in cmd[1:]])
    assert args.metrics_port == 9100


def test_images_build_from_files_in_the_repo() -> None:
    for svc in COMPOSE["services"].values():
        build = svc.get("build")
        if build:
            assert (REPO / build["dockerfile"]).is_file()
    executor = COMPOSE["x-airflow-env"]["AIRFLOW__CORE__EXECUTOR"]
    assert executor == "DRLExecutor:airflow_drl_executor.DRLExecutor"
    assert sys.version_info >= (3, 11)


def watched_dir(policy: dict) -> str:
    """The registry folder the policy server's command names."""
    return str(policy["command"][policy["command"].index("--registry") + 1])


def test_every_worker_can_run_the_nightly_retraining() -> None:
    """Any worker may run either task of ``drl_nightly_retrain`` (the policy places them): each
    reads the traces from the metadata database (``drl_traces``) and mounts, as DRL_REGISTRY_DIR,
    the volume the policy servers watch as their registry (replay files, candidates, active.json)."""
    policy = COMPOSE["services"]["policy-server"]
    registry = policy["command"][policy["command"].index("--registry") + 1]
    (watched,) = [v.split(":")[0] for v in policy["volumes"] if v.split(":")[1] == registry]
    database = COMPOSE["x-airflow-env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].replace("+psycopg2", "", 1)
    workers = {name: svc for name, svc in COMPOSE["services"].items()
               if svc.get("command", [])[:3] == ["airflow", "celery", "worker"]}
    assert workers
    for name, svc in workers.items():
        env = svc["environment"]
        assert env["AIRFLOW_CONN_DRL_TRACES"] == database, name
        assert f"{watched}:{env['DRL_REGISTRY_DIR']}" in svc.get("volumes", []), name
        assert env["AIRFLOW__CORE__EXECUTOR"] == COMPOSE["x-airflow-env"]["AIRFLOW__CORE__EXECUTOR"], name
        # finetune runs drl-trainer (torch) on whichever worker was chosen
        assert svc["build"]["args"]["INSTALL_TRAINER"] == "1", name
    for svc in ("scheduler", "api-server"):
        assert "args" not in COMPOSE["services"][svc]["build"], f"{svc}: no torch on the scheduler's side"
    # both writers of the registry volume (the workers' uid 50000, the servers' 50001) share a group
    for dockerfile in ("docker/Dockerfile.airflow", "docker/Dockerfile.policy"):
        text = (REPO / dockerfile).read_text()
        assert "groupadd --gid 50100 drl" in text and "--groups drl" in text, dockerfile
        assert f"chgrp drl {watched_dir(policy)}" in text and "chmod 2775" in text, dockerfile


def test_a_replicated_service_publishes_a_host_port_per_replica() -> None:
    """was: policy-server, 2 replicas, published "9100:9100": the second replica cannot bind it"""
    for name, svc in COMPOSE["services"].items():
        replicas = int(svc.get("deploy", {}).get("replicas", 1))
        for port in svc.get("ports", []):
            host = str(port).rsplit(":", 1)[0].split(":")[-1]
            lo, _, hi = host.partition("-")
            width = int(hi or lo) - int(lo) + 1
            assert width >= replicas, f"{name}: {replicas} replicas, host ports {host!r}"


def test_every_long_running_service_has_a_healthcheck() -> None:
    """was: only postgres and redis had one: a policy server that could not use Redis (a wrong
    password) or a dead scheduler looked up"""
    for name, svc in COMPOSE["services"].items():
        if name == "airflow-init":
            continue  # runs once
        assert svc.get("healthcheck", {}).get("test"), name
    policy = COMPOSE["services"]["policy-server"]
    port = policy["command"][policy["command"].index("--metrics-port") + 1]
    assert f"127.0.0.1:{port}/health" in " ".join(policy["healthcheck"]["test"])


def test_the_build_context_leaves_out_the_local_state() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".stack", ".stack-test", "runs"} <= set(ignored)


def test_every_airflow_container_shares_one_fernet_key() -> None:
    """was: none was set, so each container wrote its own airflow.cfg with a random key: a
    connection saved in the UI could not be read by the workers, nor after the next recreate"""
    from cryptography.fernet import Fernet

    airflow = {name: svc for name, svc in COMPOSE["services"].items()
               if svc.get("environment", {}).get("AIRFLOW__CORE__EXECUTOR")}
    assert {"scheduler", "api-server"} <= set(airflow) and len(airflow) >= 5
    keys = {svc["environment"]["AIRFLOW__CORE__FERNET_KEY"] for svc in airflow.values()}
    (key,) = keys
    default = key.split(":-", 1)[1].rstrip("}")  # ${AIRFLOW_FERNET_KEY:-...}
    Fernet(default.encode())  # a valid key


def test_the_schedulers_spool_outlives_its_container(monkeypatch: pytest.MonkeyPatch) -> None:
    """Placements the metadata DB refused wait in the spool (airflow_drl_executor/spool.py) for
    the next scheduler: in the container's own filesystem a recreate would lose them."""
    from airflow_drl_executor.spool import default_dir

    dockerfile = (REPO / "docker" / "Dockerfile.airflow").read_text()
    monkeypatch.setenv("AIRFLOW_HOME", re.search(r"AIRFLOW_HOME=(\S+)", dockerfile).group(1))
    mounts = {m.split(":")[1]: m.split(":")[0] for m in COMPOSE["services"]["scheduler"].get("volumes", [])}
    assert mounts.get(str(default_dir())) in COMPOSE["volumes"], f"{default_dir()}: not on a named volume"
    assert str(default_dir()) in dockerfile, "made in the image, owned by airflow (a new volume takes its owner)"


def test_airflows_metrics_reach_the_statsd_exporter() -> None:
    """The executor's metrics (airflow_drl_executor/metrics.py) go where Airflow's go: every Airflow
    container sends StatsD to the exporter service, on the port it listens on."""
    svc = COMPOSE["services"]["statsd-exporter"]
    assert "9102:9102" in svc["ports"]
    for name, airflow in COMPOSE["services"].items():
        env = airflow.get("environment", {})
        if env.get("AIRFLOW__CORE__EXECUTOR"):
            assert (env["AIRFLOW__METRICS__STATSD_ON"], env["AIRFLOW__METRICS__STATSD_HOST"],
                    env["AIRFLOW__METRICS__STATSD_PORT"]) == ("True", "statsd-exporter", "9125"), name
