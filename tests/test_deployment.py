"""The container deployment agrees with the code: queues, commands, files.

(No Docker engine runs on the development machines; these checks keep docker-compose.yaml honest.)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

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
