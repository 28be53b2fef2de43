"""Provider metadata (entry point ``apache_airflow_provider``): the executor, its CLI, its options."""

from __future__ import annotations

from typing import Any

from airflow_drl_executor.config import OPTIONS, SECTION, SENSITIVE


def get_cli_commands() -> list[Any]:
    """``airflow drl-executor check`` (:mod:`airflow_drl_executor.check`); ``airflow celery ...``
    comes from the Celery provider. Built at every ``airflow`` command: imports nothing heavy."""
    from airflow.cli.cli_config import ActionCommand, Arg, GroupCommand, lazy_load_command

    check = ActionCommand(
        name="check",
        help="Check that DRLExecutor can place tasks here: its options, Redis, the policy servers (and a "
             "probe placement), the pools' Celery workers, the trace table and the spool",
        func=lazy_load_command("airflow_drl_executor.check.command"),
        args=(
            Arg(("-o", "--output"), help="text (default) or json", choices=("text", "json"), default="text"),
            Arg(("--timeout",), help="seconds to wait for Redis (default: 2)", type=float, default=2.0),
            Arg(("--team",), help="check the executor of this team (multi-team deployments)", default=None),
        ),
    )
    return [GroupCommand(name="drl-executor", help="DRLExecutor's own commands", subcommands=(check,))]


def get_provider_info() -> dict[str, Any]:
    options = {
        key: {
            "description": description,
            "version_added": "0.1.0",
            "type": kind,
            "example": None,
            "default": default,
            "sensitive": key in SENSITIVE,
        }
        for key, (kind, default, description) in OPTIONS.items()
    }
    return {
        "package-name": "airflow-drl-executor",
        "name": "DRL Executor",
        "description": "An executor that asks a GNN policy server which Celery worker pool runs each task.",
        "versions": ["0.1.0"],
        "executors": ["airflow_drl_executor.DRLExecutor"],
        # Without a cli entry the inherited Celery CLI is registered twice and every airflow
        # command fails (seen on Airflow 3.3.2).
        "cli": ["airflow_drl_executor.provider.get_cli_commands"],
        "plugins": [{"name": "drl_executor", "plugin-class": "airflow_drl_executor.plugin.DRLExecutorPlugin"}],
        "config": {
            SECTION: {
                "description": "Placement of task instances on Celery worker pools by a learned policy.",
                "options": options,
            }
        },
    }
