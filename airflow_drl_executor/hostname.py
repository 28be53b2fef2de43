"""``[core] hostname_callable`` for the stack's Celery workers.

Several workers can share one machine in the demo; each gets ``DRL_WORKER_NAME`` (``pool@host``)
in its environment so the hostname Airflow records for a task instance names the worker (and so
the pool) that ran it.
"""

from __future__ import annotations

import os
import socket


def worker_hostname() -> str:
    return os.environ.get("DRL_WORKER_NAME") or socket.getfqdn()
