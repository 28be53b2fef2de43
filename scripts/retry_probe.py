"""How much the `retry` input moves the default checkpoint's decisions (docs/policy.md, "Inputs the
model never learned from"): at every third decision point of four simulated streams, each request
is placed as is, with every ready task retried (try_number 2), and with one random task retried.

    python scripts/retry_probe.py [--uncut] [POINTS_PER_STREAM] [SEED]

--uncut loads the checkpoint without cutting the inputs it never learned from (as before
2026-12-06): the figures of the README ("10-20% of simulated requests") come from
`python scripts/retry_probe.py --uncut 50 7` and `... --uncut 50 8`; without it every change is 0.
"""
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import policy.checkpoint  # noqa: E402
from policy.catalogue import load_catalogue  # noqa: E402
from policy.features import READY_FEATURES, TASK_FEATURES  # noqa: E402
from policy.gnn import GNNPlacer  # noqa: E402
from policy.model import ModelConfig, PlacementGNN  # noqa: E402
from trainer.bench import setting_jobs  # noqa: E402
from trainer.simulator import SimConfig, Simulator  # noqa: E402

UNCUT = "--uncut" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--uncut"]
if UNCUT:  # load_checkpoint looks the name up at each call
    policy.checkpoint.untrained_inputs_of = lambda model, training: []  # type: ignore[assignment]
torch.set_num_threads(1)

CK = str(ROOT / "policy" / "checkpoints" / "default")
placer = GNNPlacer.from_checkpoint(CK)
print("version", placer.version, "members", len(placer.models), "schema", [m.schema_version for m in placer.models],
      "reserve_busy", placer.reserve_busy, "allow_wait", placer.allow_wait)

# --- weights -------------------------------------------------------------------------------
t = load_file(CK + "/model.safetensors")
ri = READY_FEATURES.index("retry")
W0, W1 = t["m0.ready_in.weight"], t["m1.ready_in.weight"]
print("ready_in columns:", W0.shape[1], "retry idx", ri)
print("retry column identical across members:", np.array_equal(W0[:, ri], W1[:, ri]))
for j, name in enumerate(READY_FEATURES[:W0.shape[1]]):
    print(f"  ready col {j:2d} {name:22s} |w| m0={np.linalg.norm(W0[:, j]):.3f} m1={np.linalg.norm(W1[:, j]):.3f}"
          f" identical={np.array_equal(W0[:, j], W1[:, j])}")
for name in ("gpus", "pinned"):
    j = TASK_FEATURES.index(name)
    a, b = t["m0.task_in.weight"][:, j], t["m1.task_in.weight"][:, j]
    print(f"  task col {name:8s} |w| m0={np.linalg.norm(a):.3f} m1={np.linalg.norm(b):.3f}"
          f" identical={np.array_equal(a, b)}")
a, b = t["m0.head_pair.weight"][:, 11], t["m1.head_pair.weight"][:, 11]
print(f"  pair col pinned_here |w| m0={np.linalg.norm(a):.3f} m1={np.linalg.norm(b):.3f}"
      f" identical={np.array_equal(a, b)}")
torch.manual_seed(1)  # train.py: torch.manual_seed(args.seed) then PlacementGNN(...) (both members seed 1)
fresh = PlacementGNN(ModelConfig(hidden=32, layers=3), 4).state_dict()["ready_in.weight"].numpy()
print("retry column == fresh init (torch.manual_seed(1)):", np.array_equal(fresh[:, ri], W0[:, ri]),
      "| trained col 0 == fresh:", np.array_equal(fresh[:, 0], W0[:, 0]))

# --- decisions -----------------------------------------------------------------------------
cat = load_catalogue(ROOT / "policy" / "catalogues" / "gpu-affinity.yaml")
WF = str(ROOT.parent / "shared" / "workflows" / "wfinstances") + "/"
HELD = ",".join(f"{WF}epigenomics-chameleon-{x}-100k-001.json"
                for x in ("hep-1seq", "hep-2seq", "ilmn-1seq", "ilmn-2seq"))
SETTINGS = [("seed", 0), ("etl", 1), ("montecarlo", 2), (HELD, 3)]
PER = int(ARGS[0]) if ARGS else 50
SEED = int(ARGS[1]) if len(ARGS) > 1 else 7
rng = np.random.default_rng(SEED)

def outcome(req, graphs):
    dec = placer._decode_features(placer.features(req, graphs), 0.0, record=True)
    n = len(req.ready)
    pool = np.full(n, -1)
    sent = np.zeros(n, bool)
    for st in dec.steps:
        if st.action is not None:
            pool[st.action[0]] = st.action[1]
    sent[dec.placed_order] = True
    return pool, sent, dec.probs.copy()

def cmp(b, p, rows):
    (pb, sb, qb), (pp, sp, qp) = b, p
    both = rows[(pb[rows] >= 0) & (pp[rows] >= 0)]
    chosen = np.where(pb >= 0, pb, qb.argmax(1))
    return dict(n=len(rows), both=len(both), pool_change=int((pb[both] != pp[both]).sum()),
                sent_flip=int((sb[rows] != sp[rows]).sum()),
                to_sent=int((~sb[rows] & sp[rows]).sum()), to_unsent=int((sb[rows] & ~sp[rows]).sum()),
                chose_flip=int(((pb[rows] >= 0) != (pp[rows] >= 0)).sum()),
                dp=np.abs(qb[rows, chosen[rows]] - qp[rows, chosen[rows]]).tolist(),
                tv=(0.5 * np.abs(qb[rows] - qp[rows]).sum(1)).tolist())

agg = {"all": [], "one": []}
MISMATCH = [0]
t0 = time.time()
for spec, pos in SETTINGS:
    jobs = setting_jobs(spec, pos, SEED, cat, 30)
    sim = Simulator(cat, jobs, seed=SEED, config=SimConfig(duration_noise=0.3))
    req = sim.reset()
    k = seen = 0
    while req is not None and seen < PER:
        k += 1
        if k % 3 == 0 and req.ready:  # every 3rd decision point, spread over the stream
            g = sim.graphs
            base = outcome(req, g)
            got = sorted((d.task_id, d.pool) for d in placer.place(req, g))
            want = sorted((req.ready[r].task_id, req.pools[base[0][r]].name) for r in np.flatnonzero(base[1]))
            MISMATCH[0] += got != want
            allr = dataclasses.replace(req, ready=tuple(dataclasses.replace(x, try_number=2) for x in req.ready))
            agg["all"].append(cmp(base, outcome(allr, g), np.arange(len(req.ready))))
            i = int(rng.integers(len(req.ready)))
            one = dataclasses.replace(req, ready=tuple(dataclasses.replace(x, try_number=2) if j == i else x
                                                       for j, x in enumerate(req.ready)))
            agg["one"].append(cmp(base, outcome(one, g), np.array([i])))
            seen += 1
        req = sim.step(placer.place(req, sim.graphs))
    print(f"{spec[:40]:40s} points={seen} (of {k} visited) t={time.time()-t0:.0f}s")

print("record-path vs place() mismatches:", MISMATCH[0])
for key, rs in agg.items():
    n = sum(r["n"] for r in rs)
    both = sum(r["both"] for r in rs)
    dp = np.concatenate([r["dp"] for r in rs])
    tv = np.concatenate([r["tv"] for r in rs])
    pts = sum(1 for r in rs if r["pool_change"] or r["sent_flip"] or r["chose_flip"])
    print(f"[{key}] points={len(rs)} ready_rows={n} rows_with_pool_both={both}"
          f" pool_change={sum(r['pool_change'] for r in rs)}/{both}={sum(r['pool_change'] for r in rs)/max(both,1):.4f}"
          f" sent<->no_decision={sum(r['sent_flip'] for r in rs)}/{n}={sum(r['sent_flip'] for r in rs)/n:.4f}"
          f" pool<->stop={sum(r['chose_flip'] for r in rs)}/{n}={sum(r['chose_flip'] for r in rs)/n:.4f}"
          f" mean|dp_chosen|={dp.mean():.4f} p95={np.quantile(dp,.95):.4f} max={dp.max():.4f}"
          f" held->sent={sum(r['to_sent'] for r in rs)} sent->held={sum(r['to_unsent'] for r in rs)}"
          f" meanTV={tv.mean():.4f} points_with_any_change={pts}/{len(rs)}")
