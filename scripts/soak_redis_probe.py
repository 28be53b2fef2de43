"""Sample the private Redis of a running ``drl-policy bench --soak`` every 10 s: the request
stream's length, the consumer group's pending entries and lag, the key count, Redis's memory and
each replica's handled count (from its heartbeat), one JSON line per sample.

    python scripts/soak_redis_probe.py OUT.jsonl SECONDS   # started beside the bench

It finds the bench's server by its command line (``serve --prefix P``) and reads the Redis URL from
its environment (``DRL_POLICY_REDIS_URL``: the bench keeps it off the command line).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import redis


def main(out_path: str, seconds: float) -> int:
    deadline = time.time() + seconds
    found = None
    while time.time() < deadline and found is None:
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=False).stdout
        found = re.search(r"^\s*(\d+) .*policy\.cli .*serve --prefix (\S+)", ps, re.MULTILINE)
        time.sleep(1)
    if found is None:
        print("no drl-policy bench server found", file=sys.stderr)
        return 1
    with open(f"/proc/{found.group(1)}/environ", "rb") as fh:
        env = dict(v.split(b"=", 1) for v in fh.read().split(b"\0") if b"=" in v)
    r = redis.Redis.from_url(env[b"DRL_POLICY_REDIS_URL"].decode())
    prefix = found.group(2)
    t0 = time.time()
    with open(out_path, "w") as out:
        while time.time() < deadline:
            try:
                groups = r.xinfo_groups(f"{prefix}:requests")
                beats = r.hgetall(f"{prefix}:servers:heartbeat")
                row = {"t": round(time.time() - t0, 1), "xlen": r.xlen(f"{prefix}:requests"),
                       "pending": [g.get("pending") for g in groups], "lag": [g.get("lag") for g in groups],
                       "dbsize": r.dbsize(), "used_mb": round(r.info("memory")["used_memory"] / 2**20, 1),
                       "handled": {k.decode(): json.loads(v).get("handled") for k, v in beats.items()}}
            except redis.RedisError:  # the bench has stopped its Redis: done
                break
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(10)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
