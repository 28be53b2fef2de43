"""``[core] hostname_callable`` for the stack's Celery workers.

Several workers can share one machine in the demo; each gets ``DRL_WORKER_NAME`` (``pool@host``)
in its environment so the hostname Airflow records for a task instance names the worker (and so
the pool) that ran it.
"""

from __future__ import annotations

import os


def worker_hostname() -> str:
    """``DRL_WORKER_NAME``, else Airflow's own default (found by review: ``socket.getfqdn`` says
    ``localhost`` where the host name maps to a loopback address, CPython issue 49254, which
    Airflow's ``getfqdn`` works around)."""
    from airflow.utils.net import getfqdn

    return os.environ.get("DRL_WORKER_NAME") or getfqdn()
