"""Replicated programs in the tile model: the ring all-reduce, the replicas' sync, shared host links.

A replicated program is the program of one replica; ``replicas`` copies of it run at once,
one per IPU of a system (``protocol.hardware.System``), and meet at ``tf_ipu_all_reduce``.

    ring: the faster of two orders of the replicas' IPUs, ascending ids or the ladder's
    (even ids up, odd ids down):  IPU 0 ──> IPU 2 ──> IPU 3 ──> IPU 1 ──┐
                                    ^                                  │
                                    └──────────────────────────────────┘
    each arrow: system.path(a, b), one or more IPU-Link hops; links are full duplex
    all-reduce of B bytes per replica = reduce-scatter + all-gather, 2 (R - 1) steps:
      seconds = 2 (R - 1) / R x B / ring_bytes_per_s  +  2 (R - 1) x step_latency_s
      ring_bytes_per_s = min over arrows of (min over its hops of link bytes/s each way
                         / the arrows crossing that hop in the same direction)
      step_latency_s   = max over arrows of (sum of its hops' latencies) + step_sync_s
      step_sync_s      = external sync (below) + GCL_STEP_OVERHEAD_S (assumption)
    external sync (each call, each trip of a device loop) = target sync_cycles
                         + 2 x the hop latency of the longest path between the replicas' IPUs
                         (+ 2 x the GW-Link latency when they span several Pod64s)

    replicas spanning several Pod64s (hardware.System.pods, joined by GW-Links only): GCL's
    hierarchical all-reduce, syncful over the IPU-Links, syncless over the GW-Links
    ("Hybrid"): reduce-scatter within each pod (ring of its r replicas), all-reduce of the
    1/r shards across the P pods over the GW-Links, all-gather within each pod:
      seconds = 2 (r - 1) / r x B / ring_bytes_per_s + 2 (r - 1) x step_latency_s   IPU-Links
              + 2 (P - 1) / P x B / gw_bytes_per_s   + 2 (P - 1) x gw_step_s        GW-Links
      gw_bytes_per_s = r x (a machine's GW-Link bytes/s each way / its IPUs)   (a pod's IPUs
                       each send their shard's traffic through their machine's gateway)
      gw_step_s      = GW-Link latency + GCL_STEP_OVERHEAD_S (no external sync: syncless)
    host transfers: a host link shared by n replicas carries n x the bytes (latency once per
    direction); a call waits for its most loaded host link

Every figure is named here, or comes from the system (``hardware.py``) and the target
(``arch.py``); docs/tile_model.md ("Replicas and collectives") gives the sources.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from device_server.emulator.arch import Target
from device_server.emulator.tiles import cycles as cyc
from device_server.protocol import hardware

__all__ = ["GCL_STEP_OVERHEAD_S", "GwStage", "HostLinkLoad", "Replication", "Ring", "RingArrow",
           "all_reduce_parts", "all_reduce_seconds", "check_ipu_ids", "external_sync_seconds", "host_link_load", "replication",
           "ring_over", "transfer_seconds"]

#: Fixed cost of one step of a ring collective beyond the links' own latency and the
#: external sync: GCL's "syncful" collectives sync every step and set up the IO tiles'
#: exchange for it. Assumption (no published figure found): 1 us.
GCL_STEP_OVERHEAD_S = 1e-6


@dataclass(frozen=True)
class RingArrow:
    """One arrow of the ring: ``src`` sends its chunk to ``dst`` over ``path``."""

    src: int
    dst: int
    path: tuple[int, ...]       # IPUs from src to dst (system.path)
    bytes_per_s: float          # each way, after sharing its hops with the other arrows
    latency_s: float            # sum of its hops' latencies
    shared: int                 # most arrows crossing one of its hops in the same direction


@dataclass(frozen=True)
class GwStage:
    """The part of a hierarchical all-reduce that crosses the GW-Links between Pod64s."""

    pods: tuple[tuple[int, ...], ...]   # the replicas' IPUs in each pod they span
    per_pod: int                # r: replicas in the fullest pod (the IPU-Link rings' size)
    bytes_per_s: float          # one pod's GW-Link bandwidth for this collective, each way
    step_latency_s: float       # GW-Link latency + GCL_STEP_OVERHEAD_S

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the report."""
        return {"pods": [list(p) for p in self.pods], "per_pod": self.per_pod,
                "bytes_per_s": self.bytes_per_s, "step_latency_s": self.step_latency_s}


@dataclass(frozen=True)
class Ring:
    """The ring of a replicated program's IPUs (ascending ids) and its figures; with ``gw``,
    the ring of one pod's replicas (the slowest pod's) in a hierarchical all-reduce."""

    ipus: tuple[int, ...]
    arrows: tuple[RingArrow, ...]
    bytes_per_s: float          # the slowest arrow's
    step_latency_s: float       # the slowest arrow's latency + step_sync_s
    step_sync_s: float          # external sync + GCL_STEP_OVERHEAD_S
    gw: GwStage | None = None   # the replicas span several Pod64s: the GW-Link stage

    @property
    def links(self) -> tuple[str, ...]:
        """The kinds of link an all-reduce over this ring crosses."""
        return ("IPU-Links", "GW-Links") if self.gw is not None else ("IPU-Links",)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the report."""
        return {
            "ipus": list(self.ipus), "bytes_per_s": self.bytes_per_s,
            "step_latency_s": self.step_latency_s, "step_sync_s": self.step_sync_s,
            "arrows": [{"from": a.src, "to": a.dst, "path": list(a.path), "hops": len(a.path) - 1,
                        "bytes_per_s": a.bytes_per_s, "latency_s": a.latency_s, "shared": a.shared}
                       for a in self.arrows],
            "links": list(self.links),
            **({"gw": self.gw.to_dict()} if self.gw is not None else {}),
        }


@dataclass(frozen=True)
class HostLinkLoad:
    """The most loaded host link of a call: its replicas and the seconds of its transfers."""

    kind: str
    ipus: tuple[int, ...]
    replicas: int               # replicas whose IPU uses it
    bytes_per_s: float
    latency_s: float
    seconds: float
    # With a staging area (cycles.staged_host_seconds): the link's own seconds, overlapped
    # with the call's device time; ``seconds`` is then what the call waits for.
    network_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the report."""
        out = {"kind": self.kind, "ipus": list(self.ipus), "replicas": self.replicas,
               "bytes_per_s": self.bytes_per_s, "latency_s": self.latency_s,
               "seconds": self.seconds}
        if self.network_seconds is not None:
            out["network_seconds"] = self.network_seconds
        return out


@dataclass(frozen=True)
class Replication:
    """How a program is replicated: ``replicas`` copies on ``ipu_ids`` of ``system``, with the
    ring and the external sync they imply (made by :func:`replication`, which checks them).

    ``system`` is None only for one replica without a system (the target's own host-link
    figures then apply, as for any single-IPU program); ``ring`` is None for one replica.
    """

    replicas: int
    system: hardware.System | None
    ipu_ids: tuple[int, ...]
    target: Target
    ring: Ring | None = None
    external_sync_s: float = 0.0   # one sync across the replicas' IPUs (module docstring)

    @property
    def replicated(self) -> bool:
        """Whether several replicas run (collectives and syncs cost something)."""
        return self.replicas > 1

    def describe(self) -> str:
        """One line: replicas, system, IPUs."""
        if self.system is None:
            return "1 replica"
        many = self.replicas != 1
        return (f"{self.replicas} replica{'s' if many else ''} on {self.system.name} "
                f"IPU{'s' if many else ''} {', '.join(map(str, self.ipu_ids))}")


def _path_latency(system: hardware.System, path: list[int] | tuple[int, ...]) -> float:
    return sum(system.link(u, v).latency_s for u, v in zip(path, path[1:], strict=False))


def _latencies_from(system: hardware.System, a: int) -> dict[int, float]:
    """The latency of the fewest-hop path (``system.path``'s breadth-first order) from ``a``
    to every IPU IPU-Links reach from it."""
    out, queue = {a: 0.0}, [a]
    for here in queue:
        for there in system.neighbours(here):
            if there not in out:
                out[there] = out[here] + system.link(here, there).latency_s
                queue.append(there)
    return out


def _by_pod(system: hardware.System, ipus: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``ipus`` grouped by the pod (IPU-Link domain) holding them, pods in order."""
    groups: dict[int, list[int]] = {}
    for i in ipus:
        groups.setdefault(system.pod_of(i), []).append(i)
    return tuple(tuple(groups[p]) for p in sorted(groups))


def _external_sync(system: hardware.System, ipus: tuple[int, ...], target: Target) -> float:
    """One sync across ``ipus``: the on-chip sync (``sync_cycles``) plus a round trip over the
    longest hop path between two of them (the IPU Model's global sync: its hops' latency
    there and back); across several pods, plus a GW-Link round trip."""
    longest = 0.0
    groups = _by_pod(system, ipus)
    for group in groups:
        members = set(group)
        for a in group:
            reach = _latencies_from(system, a)
            missing = members - reach.keys()
            if missing:
                system.path(a, min(missing))   # raises: no IPU-Links join them
            longest = max([longest, *(reach[b] for b in group)])
    gw = 2.0 * system.gw_link.latency_s if len(groups) > 1 and system.gw_link is not None else 0.0
    return target.sync_cycles / target.clock_hz + 2.0 * longest + gw


def _ring(system: hardware.System, ipus: tuple[int, ...], target: Target) -> Ring:
    """The ring an all-reduce over ``ipus`` runs on: within one pod, :func:`_pod_ring`;
    across several Pod64s, the slowest pod's ring with the GW-Link stage (module docstring)."""
    groups = _by_pod(system, ipus)
    if len(groups) == 1:
        return _pod_ring(system, ipus, _external_sync(system, ipus, target) + GCL_STEP_OVERHEAD_S)
    if system.gw_link is None:
        raise ValueError(f"system {system.name!r}: IPUs {list(ipus)} span pods that no GW-Links join.")
    per_pod = max(len(g) for g in groups)
    rings = [_pod_ring(system, g, _external_sync(system, g, target) + GCL_STEP_OVERHEAD_S)
             if len(g) > 1 else None for g in groups]
    local = [r for r in rings if r is not None]
    if local:
        ring = max(local, key=lambda r: all_reduce_seconds(r, len(r.ipus), float(1 << 20)))
    else:   # one replica per pod: nothing crosses IPU-Links
        ring = Ring((groups[0][0],), (), 0.0, 0.0, 0.0)
    per_ipu = system.gw_link.bytes_per_s / max(1, system.ipus_per_machine)
    gw = GwStage(groups, per_pod, min(len(g) for g in groups) * per_ipu,
                 system.gw_link.latency_s + GCL_STEP_OVERHEAD_S)
    return dataclasses.replace(ring, gw=gw)


def _pod_ring(system: hardware.System, ipus: tuple[int, ...], step_sync_s: float) -> Ring:
    """The best of two rings over ``ipus`` (the faster all-reduce of 1 MiB): in ascending
    order, and the ladder's ring (even ids up, odd ids down: 0 2 4 ... 5 3 1, each arrow a
    single IPU-Link on the ladders of hardware.py, as GCL's rings on a ladder run)."""
    ascending = tuple(sorted(ipus))
    ladder = (tuple(i for i in ascending if i % 2 == 0)
              + tuple(i for i in reversed(ascending) if i % 2 == 1))
    rings = [_ring_in_order(system, order, step_sync_s) for order in dict.fromkeys((ascending, ladder))]
    return min(rings, key=lambda r: all_reduce_seconds(r, len(ipus), float(1 << 20)))


def _ring_in_order(system: hardware.System, order: tuple[int, ...], step_sync_s: float) -> Ring:
    """The ring over ``order`` (see module docstring)."""
    pairs = [(order[n], order[(n + 1) % len(order)]) for n in range(len(order))]
    paths = [tuple(system.path(a, b)) for a, b in pairs]
    load: dict[tuple[int, int], int] = {}   # arrows crossing each hop, per direction
    for p in paths:
        for hop in zip(p, p[1:], strict=False):
            load[hop] = load.get(hop, 0) + 1
    arrows = []
    for (a, b), p in zip(pairs, paths, strict=True):
        hops = list(zip(p, p[1:], strict=False))
        bw = min(system.link(u, v).bytes_per_s / load[(u, v)] for u, v in hops)
        arrows.append(RingArrow(a, b, p, bw, _path_latency(system, p),
                                max(load[hop] for hop in hops)))
    return Ring(order, tuple(arrows), min(a.bytes_per_s for a in arrows),
                max(a.latency_s for a in arrows) + step_sync_s, step_sync_s)


def check_ipu_ids(ids: tuple[int, ...], system: hardware.System) -> None:
    """ValueError unless ``ids`` are distinct IPUs of ``system``."""
    bad = [i for i in ids if not 0 <= i < system.num_ipus]
    if bad:
        raise ValueError(f"ipu_ids {bad} are not IPUs of system {system.name!r} "
                         f"(0 .. {system.num_ipus - 1}).")
    if len(set(ids)) != len(ids):
        raise ValueError(f"ipu_ids must be distinct (one IPU per replica, or per stage's IPU). "
                         f"Received: {list(ids)}")


def replication(replicas: int, system: hardware.System | str | None,
                ipu_ids: tuple[int, ...] | list[int], target: Target) -> Replication:
    """The checked replication of a program compiled for ``target`` (``system``: a System or
    the name of one).

    Without a system, several replicas run on ``plain_system`` IPUs of the target's version
    (linked as its machines are, as ``--ipus N`` makes them); one replica keeps the target's
    own host-link figures. Empty ``ipu_ids``: the system's first ``replicas`` IPUs.

    Raises:
        ValueError: naming the numbers, for fewer than 1 replica, more replicas than the
            system has IPUs, ``ipu_ids`` not one distinct IPU of the system per replica, or a
            system of another IPU version than the target.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1. Received: replicas={replicas!r}")
    ids = tuple(int(i) for i in ipu_ids or ())
    if isinstance(system, str):
        system = hardware.get_system(system) if system else None
    if system is None:
        if replicas == 1 and not ids:
            return Replication(1, None, (), target)
        system = hardware.plain_system(max(replicas, max(ids, default=-1) + 1), target.name)
    if system.ipu_version != target.name:
        raise ValueError(
            f"system {system.name!r} has {system.product} IPUs ({system.ipu_version}); the program "
            f"is compiled for {target.product} ({target.name}).")
    if replicas > system.num_ipus:
        raise ValueError(
            f"{replicas} replicas need {replicas} IPUs (one per replica), but system "
            f"{system.name!r} has {system.num_ipus} IPU{'s' if system.num_ipus != 1 else ''}.")
    if ids:
        if len(ids) != replicas:
            raise ValueError(f"ipu_ids must name one IPU per replica: {len(ids)} IPU ids "
                             f"{list(ids)} for {replicas} replicas.")
        check_ipu_ids(ids, system)
    else:
        ids = tuple(range(replicas))
    if replicas == 1:
        return Replication(1, system, ids, target)
    sync = _external_sync(system, ids, target)   # ValueError: two IPUs no IPU-Links join
    return Replication(replicas, system, ids, target, _ring(system, ids, target), sync)


def ring_over(system: hardware.System, ipus: tuple[int, ...], target: Target) -> Ring:
    """The ring an all-reduce over ``ipus`` (two or more) runs on (as for replicas)."""
    return _ring(system, ipus, target)


def external_sync_seconds(system: hardware.System, ipus: tuple[int, ...], target: Target) -> float:
    """One sync across ``ipus`` (see module docstring)."""
    return _external_sync(system, ipus, target)


def transfer_seconds(system: hardware.System, a: int, b: int, nbytes: float) -> float:
    """``nbytes`` from IPU ``a`` to IPU ``b`` over ``system.path``: at the slowest hop's
    bandwidth (each way), plus the hops' latencies; 0 on one IPU."""
    if a == b or nbytes <= 0:
        return 0.0
    path = system.path(a, b)
    hops = list(zip(path, path[1:], strict=False))
    return nbytes / min(system.link(u, v).bytes_per_s for u, v in hops) + _path_latency(system, path)


def all_reduce_parts(ring: Ring, replicas: int, nbytes: float) -> dict[str, float]:
    """Seconds of an all-reduce of ``nbytes`` per replica on each kind of link it crosses:
    ``{"IPU-Links": s}``, and ``"GW-Links"`` for a ring spanning Pod64s (module docstring)."""
    if replicas <= 1 or nbytes <= 0:
        return {link: 0.0 for link in ring.links}
    if ring.gw is None:
        steps = 2 * (replicas - 1)
        return {"IPU-Links": steps / replicas * nbytes / ring.bytes_per_s
                + steps * ring.step_latency_s}
    r, p = ring.gw.per_pod, len(ring.gw.pods)
    local = (2 * (r - 1) / r * nbytes / ring.bytes_per_s + 2 * (r - 1) * ring.step_latency_s
             if r > 1 else 0.0)
    cross = 2 * (p - 1) / p * nbytes / ring.gw.bytes_per_s + 2 * (p - 1) * ring.gw.step_latency_s
    return {"IPU-Links": local, "GW-Links": cross}


def all_reduce_seconds(ring: Ring, replicas: int, nbytes: float) -> float:
    """Seconds of an all-reduce of ``nbytes`` per replica (see module docstring)."""
    return sum(all_reduce_parts(ring, replicas, nbytes).values())


def host_link_load(rep: Replication, bytes_in: int, bytes_out: int,
                   device_seconds: float | None = None) -> HostLinkLoad:
    """The host link whose transfers take longest in one call, each replica streaming
    ``bytes_in`` to its IPU and ``bytes_out`` back; without a system, the target's figures.
    With ``device_seconds`` (the call's time on the IPUs) on a system with Streaming Memory,
    the transfers are prefetched through it (``cycles.staged_host_seconds``): ``seconds`` is
    what the call waits for beyond ``device_seconds``."""
    t = rep.target
    if rep.system is None:
        return HostLinkLoad("the target's host link", (), 1, t.host_link_bytes_per_s,
                            t.host_link_latency_s, cyc.host_seconds(t, bytes_in, bytes_out))
    best: HostLinkLoad | None = None
    for h in rep.system.host_links:
        n = sum(1 for i in rep.ipu_ids if i in h.ipus)
        if n == 0:
            continue
        s = cyc.host_seconds(t, bytes_in, bytes_out, bytes_per_s=h.bytes_per_s,
                             latency_s=h.latency_s, sharers=n)
        network = None
        staging = float(getattr(rep.system, "streaming_memory_bytes_per_s", 0.0) or 0.0)
        if device_seconds is not None and staging > 0:
            network, s = s, cyc.staged_host_seconds(t, s, bytes_in, bytes_out, staging,
                                                    device_seconds)
        if best is None or s > best.seconds:
            best = HostLinkLoad(h.kind, tuple(h.ipus), n, h.bytes_per_s, h.latency_s, s, network)
    assert best is not None
    return best
