"""Per ``--rss-every`` interval of a ``drl-policy bench --soak`` JSON: the replies per second,
the cores the replicas used and their CPU milliseconds per reply (whether work per request grows).

    python scripts/soak_cpu_per_request.py SOAK.json [SOAK.json ...]
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> int:
    for path in paths:
        soak = json.load(open(path))["soak"]
        timeline, cpu = soak["timeline"], soak["replicas_cpu_s"]
        print(f"{path}: {soak['achieved_rate']}/s achieved, {soak['errors']} errors")
        for i in range(1, min(len(timeline), len(cpu))):
            t, rate = timeline[i]
            dt = cpu[i][0] - cpu[i - 1][0]
            used = sum(cpu[i][1:]) - sum(cpu[i - 1][1:])
            print(f"  t={t:5.0f} s  {rate:6.0f}/s  replicas {used / dt:.2f} cores  "
                  f"{1000 * used / max(1.0, rate * dt):.3f} ms CPU a reply")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
