"""The pool catalogue: which worker pools (Celery queues) exist, on which VM classes.

A catalogue is a YAML file read once where it enters (executor start, server start, simulator
set-up) and validated there; errors name the file and the field::

    vm_classes:
      small-cpu: {cpus: 4, memory_gb: 16, speed: 1.0, price_per_hour: 0.17}
      gpu-a10:   {cpus: 8, memory_gb: 64, gpus: 1, speed: 1.5, price_per_hour: 1.0,
                  affinity: {gpu_train: 8.0}}
    pools:
      cpu-small: {vm_class: small-cpu, workers: 2, slots_per_worker: 4}
      gpu:       {vm_class: gpu-a10, workers: 1, slots_per_worker: 2,
                  min_workers: 0, max_workers: 4, boot_delay_s: 90}

``workers`` is the number of workers running now (fixed pools) or at start (elastic pools);
``min_workers``/``max_workers``/``boot_delay_s``/``idle_scale_down_s``/``billing_s`` describe
KEDA-style autoscaling for the simulator.

Every key of a VM class or pool must be one of :data:`VM_CLASS_KEYS` / :data:`POOL_KEYS`, and no
key may appear twice in one mapping: a typo (``worker: 5``) or a pool listed twice would
otherwise load silently as the defaults or as the last entry (found by a deployment review).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from policy.errors import CatalogueError
from policy.files import read_bounded
from policy.schema import MAX_POOLS, PoolState, _finite

#: the folder of the catalogues this package ships (``gpu-affinity.yaml``, ``demo.yaml``, ...)
PACKAGED_CATALOGUES = Path(__file__).resolve().parent / "catalogues"

#: the keys a VM class may have (the fields of :class:`VMClass` but its name)
VM_CLASS_KEYS = ("cpus", "memory_gb", "gpus", "speed", "price_per_hour", "affinity")
#: the keys a pool may have (the fields of :class:`PoolSpec` but its name)
POOL_KEYS = ("vm_class", "workers", "slots_per_worker", "min_workers", "max_workers", "boot_delay_s",
             "idle_scale_down_s", "billing_s")


@dataclass(frozen=True)
class VMClass:
    """A kind of machine: resources of one VM, relative speed, hourly price, task-type affinity."""

    name: str
    cpus: float
    memory_gb: float
    gpus: float = 0.0
    speed: float = 1.0
    price_per_hour: float = 0.0
    affinity: Mapping[str, float] = field(default_factory=dict)

    def speed_for(self, kind: str) -> float:
        """Effective speed for a task of type ``kind`` (as :meth:`PoolState.speed_for`)."""
        return self.speed * self.affinity.get(kind, 1.0)


@dataclass(frozen=True)
class PoolSpec:
    """A worker pool: one Celery queue served by workers of one VM class."""

    name: str
    vm_class: VMClass
    workers: int
    slots_per_worker: int = 1
    min_workers: int | None = None
    max_workers: int | None = None
    boot_delay_s: float = 0.0
    idle_scale_down_s: float = 300.0
    billing_s: float = 1.0

    @property
    def slots(self) -> int:
        return self.workers * self.slots_per_worker

    @property
    def floor(self) -> int:
        """The fewest workers the pool runs (``min_workers``, else ``workers``); 0: it may scale to zero."""
        return self.workers if self.min_workers is None else self.min_workers

    @property
    def ceiling(self) -> int:
        """The most workers the pool runs (``max_workers``, else ``workers``)."""
        return self.workers if self.max_workers is None else self.max_workers

    @property
    def ceiling_slots(self) -> int:
        """The pool's slots at its :attr:`ceiling`."""
        return self.ceiling * self.slots_per_worker

    @property
    def elastic(self) -> bool:
        return (self.floor, self.ceiling) != (self.workers, self.workers)

    def state(self, *, busy: int = 0, queued: int = 0, up: bool = True, workers: int | None = None,
              failure_rate: float = 0.0) -> PoolState:
        """This pool's :class:`PoolState` with the given load."""
        vm = self.vm_class
        n = self.workers if workers is None else workers
        return PoolState(
            name=self.name, vm_class=vm.name, slots=n * self.slots_per_worker, cpus=vm.cpus,
            memory_gb=vm.memory_gb, gpus=vm.gpus, speed=vm.speed, price_per_hour=vm.price_per_hour,
            busy=busy, queued=queued, up=up, failure_rate=failure_rate, affinity=vm.affinity,
        )


@dataclass(frozen=True)
class Catalogue:
    """All pools of a cluster, in file order."""

    pools: tuple[PoolSpec, ...]
    source: str = "<memory>"

    def __post_init__(self) -> None:
        if not self.pools:
            raise CatalogueError(f"{self.source}: no pools")

    def pool(self, name: str) -> PoolSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise CatalogueError(f"{self.source}: pool {name!r} not in the catalogue")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)

    def states(self) -> tuple[PoolState, ...]:
        """Every pool idle."""
        return tuple(p.state() for p in self.pools)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, line: int, first: int) -> None:
        super().__init__(f"line {line}: duplicate key {key!r} (first at line {first})")
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last).

    Keys brought in by a merge (``<<: *base``) may still be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in first:
                raise _DuplicateKey(key, line, first[key])
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def _check_keys(obj: Mapping[Any, Any], known: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise CatalogueError(f"{where}: unknown key {key!r} ({hint}known: {', '.join(known)})")


def _number(obj: Mapping[str, Any], key: str, where: str, default: float | None = None,
            lo: float = 0.0) -> float:
    value = obj.get(key, default)
    if value is None:
        raise CatalogueError(f"{where}.{key}: missing")
    if not _finite(value) or value < lo:
        raise CatalogueError(f"{where}.{key}: expected a finite number >= {lo}, got {_short(value)}")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _name(name: Any, where: str) -> str:
    """A VM class or pool name as written: a non-empty string (found by review: YAML reads an
    unquoted ``off`` as false, ``null`` as None and ``010`` as 8, and ``str()`` of them made queues
    "False", "None" and "8" that no worker consumes, or let ``1`` and ``'1'`` be two pools of one
    queue; an empty name loaded and then every request was refused on the wire)."""
    if not isinstance(name, str) or not name:
        raise CatalogueError(f"{where}: a name must be a non-empty string, got {_short(name)} "
                             f"(YAML reads an unquoted off, null or 010 as no string: quote the name)")
    return name


#: at most this many workers in a pool and slots on a worker: a pool's slots (their product) then
#: stay within what the wire takes (``policy.schema.MAX_INT``; found by review: max_workers 1e9 meant
#: "no limit" loaded here and made the server refuse every request, every placement a fallback)
MAX_WORKERS = 100_000
MAX_SLOTS_PER_WORKER = 10_000


def _count(obj: Mapping[str, Any], key: str, where: str, default: int | None = None,
           lo: int = 0, hi: int = MAX_WORKERS) -> int | None:
    value = obj.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CatalogueError(f"{where}.{key}: expected an integer in {lo}..{hi}, got {value!r}")
    return value


def parse_catalogue(data: Any, source: str = "<memory>") -> Catalogue:
    """Build a :class:`Catalogue` from the decoded YAML document ``data``."""
    if not isinstance(data, Mapping):
        raise CatalogueError(f"{source}: expected a mapping with vm_classes and pools")
    raw_vms = data.get("vm_classes")
    raw_pools = data.get("pools")
    if not isinstance(raw_vms, Mapping) or not raw_vms:
        raise CatalogueError(f"{source}: vm_classes: expected a non-empty mapping")
    if not isinstance(raw_pools, Mapping) or not raw_pools:
        raise CatalogueError(f"{source}: pools: expected a non-empty mapping")
    if len(raw_pools) > MAX_POOLS:
        raise CatalogueError(f"{source}: pools: {len(raw_pools)} pools, the wire takes at most {MAX_POOLS} "
                             f"a request")
    vms: dict[str, VMClass] = {}
    for key, spec in raw_vms.items():
        name = _name(key, f"{source}: vm_classes")
        where = f"{source}: vm_classes.{name}"
        if not isinstance(spec, Mapping):
            raise CatalogueError(f"{where}: expected a mapping")
        _check_keys(spec, VM_CLASS_KEYS, where)
        affinity = spec.get("affinity") or {}
        if not isinstance(affinity, Mapping) or not all(
            isinstance(k, str) and _finite(v) and v >= 0.001 for k, v in affinity.items()
        ):
            raise CatalogueError(f"{where}.affinity: expected {{task kind: finite speed-up >= 0.001}}, "
                                 f"got {_short(affinity)}")
        vms[name] = VMClass(
            name=name,
            cpus=_number(spec, "cpus", where, lo=0.001),
            memory_gb=_number(spec, "memory_gb", where, lo=0.001),
            gpus=_number(spec, "gpus", where, 0.0),
            speed=_number(spec, "speed", where, 1.0, lo=0.001),
            price_per_hour=_number(spec, "price_per_hour", where, 0.0),
            affinity={str(k): float(v) for k, v in affinity.items()},
        )
    pools: list[PoolSpec] = []
    for key, spec in raw_pools.items():
        name = _name(key, f"{source}: pools")
        where = f"{source}: pools.{name}"
        if not isinstance(spec, Mapping):
            raise CatalogueError(f"{where}: expected a mapping")
        _check_keys(spec, POOL_KEYS, where)
        vm_name = spec.get("vm_class")
        if not isinstance(vm_name, str) or vm_name not in vms:
            raise CatalogueError(f"{where}.vm_class: expected the name of a VM class, one of {sorted(vms)}, "
                                 f"got {vm_name!r}")
        workers = _count(spec, "workers", where, 1)
        assert workers is not None
        pool = PoolSpec(
            name=name,
            vm_class=vms[vm_name],
            workers=workers,
            slots_per_worker=_count(spec, "slots_per_worker", where, 1, lo=1, hi=MAX_SLOTS_PER_WORKER) or 1,
            min_workers=_count(spec, "min_workers", where),
            max_workers=_count(spec, "max_workers", where),
            boot_delay_s=_number(spec, "boot_delay_s", where, 0.0),
            idle_scale_down_s=_number(spec, "idle_scale_down_s", where, 300.0),
            billing_s=_number(spec, "billing_s", where, 1.0, lo=0.001),
        )
        lo = pool.min_workers if pool.min_workers is not None else workers
        hi = pool.max_workers if pool.max_workers is not None else workers
        if not lo <= workers <= hi:
            raise CatalogueError(f"{where}: need min_workers <= workers <= max_workers, got {lo}/{workers}/{hi}")
        if hi == 0:
            raise CatalogueError(f"{where}: max_workers must be at least 1")
        pools.append(pool)
    return Catalogue(pools=tuple(pools), source=source)


def load_catalogue(path: str | Path) -> Catalogue:
    """Read and validate a catalogue YAML file."""
    path = Path(path)
    try:
        text = read_bounded(path).decode("utf-8")
    except OSError as exc:
        raise CatalogueError(f"{path}: cannot read the pool catalogue: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise CatalogueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds plain data only
    except _DuplicateKey as exc:
        raise CatalogueError(f"{path}: {exc}; each VM class, pool and field may appear once") from exc
    except yaml.YAMLError as exc:
        raise CatalogueError(f"{path}: not valid YAML: {exc}") from exc
    return parse_catalogue(data, str(path))
