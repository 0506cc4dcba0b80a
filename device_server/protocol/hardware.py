"""IPU versions and multi-IPU systems: the names host and server share, and each system's links.

    version   "ipu1" (GC2) | "ipu2" (GC200) | "bow" (Bow; Poplar: "ipu21")            VERSIONS
    system    "c2" | "dss8440" | "m2000" | "bow2000" | "pod16" | "bow-pod16"          SYSTEMS
              | "pod64" | "pod128" | "pod256" | "bow-pod64" | "bow-pod128" | "bow-pod256"
              (or plain_system(n, version) for ``--ipus N``)

    a system:  IPU 0 ══ IPU 1        ══  IPU-Links between a pair of IPUs (Link: bytes/s
                 ║        ║              each way, latency per transfer)
               IPU 2 ══ IPU 3        host links: one per group of IPUs that shares it
                 └── host link ──┘   (HostLink: a C2 card's PCIe, an M2000's gateway)

    a pod of Pod64s:  Pod64 #0 (16 machines, IPU-Link torus) ══GW-Links══ Pod64 #1 ...
                      ``pods``: the IPU-Link domains (IPUs 64p .. 64p+63); between them only
                      the machines' GW-Links (``GwLink``: bytes/s each way per machine)
    host servers:     ``hosts`` (1 per Pod64), each feeding its machines' gateways through
                      its NICs (``host_server_bytes_per_s``; ``host_feed`` states what a
                      rate asks of them: not charged by the estimate)

This module is the one place where versions and systems are named: the client's IPUConfig,
the server's ``--ipu-version`` / ``--system`` flags and the emulator's presets
(``device_server/emulator/arch.py``, which holds each version's cost figures) all read it. It
imports nothing heavy, so the client can use it without the emulator. Sources are those of
``/work/shared/ipu_arch.md``; a figure nobody published is a named assumption in
``System.assumptions``, to be corrected here.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = [
    "SYSTEMS", "VERSIONS", "GwLink", "HostLink", "IpuVersion", "Link", "System", "canonical_version",
    "get_system", "plain_system",
]


@dataclass(frozen=True)
class IpuVersion:
    """One IPU chip: its canonical name, the names it is also known by, and its tiles."""

    name: str               # canonical: "ipu1", "ipu2", "bow"
    product: str            # "GC2", "GC200", "Bow"
    poplar_name: str        # Poplar's spelling: "ipu1", "ipu2", "ipu21"
    tiles: int              # tiles on the chip
    aliases: tuple[str, ...] = ()


VERSIONS: dict[str, IpuVersion] = {
    v.name: v for v in (
        IpuVersion("ipu1", "GC2", "ipu1", 1216, ("gc2",)),      # 16 x 19 x 4 tiles (Burchard s.2)
        IpuVersion("ipu2", "GC200", "ipu2", 1472, ("gc200",)),  # Graphcore product pages
        IpuVersion("bow", "Bow", "ipu21", 1472, ("ipu21",)),    # the GC200's tiles, 3D silicon
    )
}
_VERSION_NAMES = {alias: v.name for v in VERSIONS.values() for alias in (v.name, *v.aliases)}


def canonical_version(name: str) -> str:
    """The canonical version for ``name`` (any case, any alias); ValueError naming the
    accepted names otherwise."""
    key = _VERSION_NAMES.get(str(name).lower())
    if key is None:
        raise ValueError(f"Unknown IPU version {name!r}; accepted: "
                         f"{', '.join(repr(n) for n in sorted(_VERSION_NAMES))}.")
    return key


@dataclass(frozen=True)
class Link:
    """The IPU-Links joining IPUs ``a`` and ``b``, as one connection."""

    a: int
    b: int
    bytes_per_s: float      # each way, all the pair's links together
    latency_s: float        # one transfer over the connection (each way)


@dataclass(frozen=True)
class HostLink:
    """One link to the host, shared by ``ipus``."""

    ipus: tuple[int, ...]
    bytes_per_s: float      # each way
    latency_s: float        # fixed cost of one transfer
    kind: str               # "PCIe Gen4 x16", "100 GbE RoCEv2 through the IPU-Gateway"


@dataclass(frozen=True)
class GwLink:
    """The GW-Links of one IPU-Machine (through its IPU-Gateway), joining its Pod64 to others."""

    ports: int              # GW-Link ports per machine
    line_bytes_per_s: float     # each port's line rate, each way
    bytes_per_s: float      # what a machine moves to other pods, each way (all ports, after
                            # the efficiency and the gateway's own link to its IPUs)
    latency_s: float        # one transfer, IPU to IPU through two gateways
    kind: str               # "2 x 100 GbE GW-Links (direct cables)", "... (switched)"


@dataclass(frozen=True)
class System:
    """A named set of IPUs of one version, its IPU-Link graph and its host links."""

    name: str
    description: str
    ipu_version: str
    num_ipus: int
    links: tuple[Link, ...]
    host_links: tuple[HostLink, ...]
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    streaming_memory_bytes: int = 0            # per IPU, the DRAM beside it (0: none)
    streaming_memory_bytes_per_s: float = 0.0  # per IPU, each way
    machines: int = 0          # IPU-Machines (M2000 / Bow-2000); 0: not built of machines
    hosts: int = 1             # host servers
    host_server_bytes_per_s: float = 0.0   # what one host server's RoCE NICs move to its
                                           # machines, each way (0: not stated); reported,
                                           # not charged (System.host_feed)
    pods: tuple[tuple[int, ...], ...] = ()    # IPU-Link domains (Pod64s); (): one, all IPUs
    gw_link: GwLink | None = None              # the machines' GW-Links between the pods
    _adjacency: dict[int, dict[int, Link]] = field(default_factory=dict, compare=False, repr=False)
    _pod_index: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for n, pod in enumerate(self.pods):
            for i in pod:
                self._pod_index[i] = n
        for link in self.links:
            for i in (link.a, link.b):
                if not 0 <= i < self.num_ipus:
                    raise ValueError(f"system {self.name}: link {link} names IPU {i}.")
            self._adjacency.setdefault(link.a, {})[link.b] = link
            self._adjacency.setdefault(link.b, {})[link.a] = link
        hosted = sorted(i for h in self.host_links for i in h.ipus)
        if hosted != list(range(self.num_ipus)):
            raise ValueError(f"system {self.name}: every IPU needs exactly one host link.")
        if self.pods and sorted(i for p in self.pods for i in p) != list(range(self.num_ipus)):
            raise ValueError(f"system {self.name}: every IPU needs exactly one pod.")
        for link in self.links:
            if self.pod_of(link.a) != self.pod_of(link.b):
                raise ValueError(f"system {self.name}: IPU-Link {link} joins two pods "
                                 "(pods are joined by GW-Links only).")

    @property
    def ipus_per_machine(self) -> int:
        """IPUs of one machine (4 for an M2000 or Bow-2000), 0 if not built of machines."""
        return self.num_ipus // self.machines if self.machines else 0

    def host_feed(self, bytes_per_s: float, hosts: int = 0) -> str:
        """``bytes_per_s`` streamed from ``hosts`` host servers (0: ``self.hosts``) to all the
        IPUs, against what each one's NICs carry (``host_server_bytes_per_s``): one line; ""
        if not stated."""
        if not self.host_server_bytes_per_s:
            return ""
        hosts = hosts or self.hosts
        per_host = bytes_per_s / hosts
        return (f"{per_host / 1e9:.1f} GB/s from each of {hosts} host server"
                f"{'s' if hosts != 1 else ''}: {per_host / self.host_server_bytes_per_s:.0%} "
                f"of its NICs' {self.host_server_bytes_per_s / 1e9:g} GB/s")

    @property
    def num_pods(self) -> int:
        """IPU-Link domains (Pod64s) the system has; 1 without ``pods``."""
        return max(1, len(self.pods))

    def pod_of(self, ipu: int) -> int:
        """The pod (IPU-Link domain) of ``ipu``; 0 without ``pods``."""
        return self._pod_index.get(ipu, 0)

    @property
    def product(self) -> str:
        """The IPUs' product name (e.g. "GC2")."""
        return VERSIONS[self.ipu_version].product

    def link(self, a: int, b: int) -> Link | None:
        """The connection between IPUs ``a`` and ``b``, or None if they are not neighbours."""
        return self._adjacency.get(a, {}).get(b)

    def neighbours(self, ipu: int) -> list[int]:
        """The IPUs joined to ``ipu`` by IPU-Links, ascending."""
        return sorted(self._adjacency.get(ipu, {}))

    def host_link(self, ipu: int) -> HostLink:
        """The host link ``ipu`` uses."""
        return next(h for h in self.host_links if ipu in h.ipus)

    def path(self, a: int, b: int) -> list[int]:
        """The IPUs from ``a`` to ``b`` over the fewest IPU-Link hops (``[a]`` if equal);
        ValueError if no IPU-Links join them."""
        if a == b:
            return [a]
        if self.pod_of(a) != self.pod_of(b):
            raise ValueError(f"system {self.name}: no IPU-Links join IPU {a} (pod {self.pod_of(a)}) "
                             f"and IPU {b} (pod {self.pod_of(b)}): the pods are joined by GW-Links only.")
        previous = {a: a}
        queue = collections.deque([a])
        while queue:
            here = queue.popleft()
            for there in self.neighbours(here):
                if there not in previous:
                    previous[there] = here
                    if there == b:
                        route = [b]
                        while route[-1] != a:
                            route.append(previous[route[-1]])
                        return route[::-1]
                    queue.append(there)
        raise ValueError(f"system {self.name}: no IPU-Links join IPU {a} and IPU {b}.")

    def summary(self) -> str:
        """One line: name, IPUs, links, host links."""
        hosts = collections.Counter(h.kind for h in self.host_links)
        out = (f"{self.name}: {self.num_ipus} {self.product} IPUs, {len(self.links)} IPU-Link "
               f"connections, host links: "
               + ", ".join(f"{n} x {kind}" for kind, n in hosts.items()))
        if self.machines:
            out += f"; {self.machines} machines, {self.hosts} host server{'s' if self.hosts != 1 else ''}"
        if self.num_pods > 1 and self.gw_link is not None:
            out += (f"; {self.num_pods} Pod64s joined by {self.gw_link.kind} "
                    f"({self.gw_link.bytes_per_s / 1e9:g} GB/s each way per machine)")
        return out


# ---- figures (ipu_arch.md; "derived" = arithmetic on published figures) ----------------------
_HOP_LATENCY_S = 15e-9            # IPU Model's inter-IPU cost: ~15 ns per hop each way (Poplar)
_PCIE4_X16_BYTES_PER_S = 32e9     # PCIe Gen4 x16: 64 GB/s counting both directions (Louw s.II-III)
_PCIE_LATENCY_S = 5e-6            # assumption: fixed cost of one host transfer
_GATEWAY_BYTES_PER_S = 5.5e9      # M2000/Bow-2000 host via 100 GbE RoCEv2: as graphcore/examples assume
_GATEWAY_LATENCY_S = 10e-6        # assumption: RoCE round trip through the gateway
# C2 card: 3 IPU-Links of 64 GB/s bidirectional each; 2 join the card's pair (Jia et al. 2019).
_C2_PAIR_BYTES_PER_S = 2 * 32e9   # derived: 2 links x 32 GB/s each way
_C2_CARD_TO_CARD_BYTES_PER_S = 32e9  # assumption: the third link, 32 GB/s each way, to the next card
# GC200: 10 IPU-Links, 320 GB/s per IPU (secondary source); Bow-2000: IPU-Link 512 Gbit/s.
_GC200_NEIGHBOUR_BYTES_PER_S = 320e9 / 2 / 3   # derived, with the assumptions below
_BOW_NEIGHBOUR_BYTES_PER_S = 10 * 64e9 / 2 / 3  # derived: 10 links x 512 Gbit/s, as above
# Streaming Memory (Mk2 machines; a C2 card has none): an IPU-Machine holds four IPUs and "up
# to 260 GB" of memory, 3.6 GB of it In-Processor-Memory (IPU programmer's guide, "IPU hardware
# overview"); the rest split evenly by the 4 IPUs (derived). Its bandwidth is not published:
# assumption, one DDR4-3200 channel per IPU (25.6 GB/s) at 80% of its peak.
_STREAMING_MEMORY_BYTES_PER_IPU = int((260e9 - 3.6e9) / 4)
_STREAMING_MEMORY_BYTES_PER_S = 20e9


# Pods of Pod64s (ipu-pod64 / ipu-pod128 datasheets, bow-pod256 datasheet, docs.graphcore.ai
# "Switched GW-Links in large scale Pod systems", IPU-POD DA build and test guide):
_POD64_MACHINES = 16      # a Pod64 is 16 IPU-Machines (M2000 or Bow-2000), 64 IPUs
_HOSTS_PER_POD64 = 1      # datasheets: 1 to 4 host servers, 1 by default; the MLPerf logs'
                          # Pod64 / Pod128 / Pod256 runs state 1 / 2 / 4 hosts (n_hosts), as
                          # BERT v1.1's Pod128 script runs (2 hosts, 2 instances); ResNet-50
                          # v1.1's run_and_time.sh ran 4 per Pod64 (16 on a Pod256), with an
                          # instance per 2 replicas to feed them (its README: more input feeds)
_GW_LINK_PORTS = 2        # GW-Link ports per machine (M2000: DA build guide; Bow-2000 datasheet)
_GW_LINK_LINE_BYTES_PER_S = 100e9 / 8   # 100 Gbit/s each way per port (100 GbE; Bow-2000 datasheet)
_GW_LINK_EFFICIENCY = 0.85              # assumption: the IPU Model's link efficiency (Poplar)
# The IPU-Gateway reaches its machine's IPUs over PCIe Gen4 x8 (~16 GB/s each way): secondary
# source (vengineer.hatenablog.com, 2023-01-23, quoting the block diagram of Graphcore's BMC
# user guide for the IPU-M2000); assumed the same on a Bow-2000.
_GATEWAY_TO_IPUS_BYTES_PER_S = 16e9
_GW_MACHINE_BYTES_PER_S = min(_GW_LINK_PORTS * _GW_LINK_LINE_BYTES_PER_S * _GW_LINK_EFFICIENCY,
                              _GATEWAY_TO_IPUS_BYTES_PER_S)   # derived: 16 GB/s each way
_GW_LINK_LATENCY_S = 10e-6   # assumption: one RoCE transfer IPU -> gateway -> gateway -> IPU
# The host server's data plane: the Pod64 build and test guide's server has a "single/dual
# port Mellanox ConnectX-5 EN 100Gb/s Ethernet" RNIC (the IPU-POD DA guide's Pod16 host: "a
# 100GbE RoCEv2 NIC"); the dual port is taken, at the line rate (an upper bound). Not charged
# by the estimate, whose host-link load is each machine's gateway link (replication.py):
# bench_mlperf reports what each measured run's rate asked of every host (System.host_feed).
_HOST_NIC_PORTS = 2
_HOST_NIC_BYTES_PER_S = _HOST_NIC_PORTS * 100e9 / 8


def _ladder(num_ipus: int, rung: float, rail: float, ring: bool = False) -> tuple[Link, ...]:
    """IPUs 2k and 2k+1 joined (rungs), and IPU i to IPU i+2 (rails); ``ring`` joins the
    ends of the rails too (a torus of the ladder's length)."""
    links = [Link(i, i + 1, rung, _HOP_LATENCY_S) for i in range(0, num_ipus - 1, 2)]
    links += [Link(i, i + 2, rail, _HOP_LATENCY_S) for i in range(num_ipus - 2)]
    if ring and num_ipus > 4:
        links += [Link(num_ipus - 2, 0, rail, _HOP_LATENCY_S), Link(num_ipus - 1, 1, rail, _HOP_LATENCY_S)]
    return tuple(links)


def _host_links(num_ipus: int, per: int, bytes_per_s: float, latency_s: float,
                kind: str) -> tuple[HostLink, ...]:
    return tuple(HostLink(tuple(range(i, i + per)), bytes_per_s, latency_s, kind)
                 for i in range(0, num_ipus, per))


_PCIE = "PCIe Gen4 x16"
_GATEWAY = "100 GbE RoCEv2 through the IPU-Gateway"
_MK2_ASSUMPTIONS = (
    "the IPUs of a machine form a ladder (IPU 2k and 2k+1 joined; IPU i and i+2 joined), each "
    "IPU's links shared evenly by its 3 neighbours, the quoted per-IPU figure counting both "
    "directions",
    "host transfers reach the gateway at the rate Graphcore's examples assume (5.5 GB/s), "
    "not the 100 GbE line rate",
    "Streaming Memory: 64 GB per IPU (derived from the IPU-Machine's 260 GB), read and "
    "written at 20 GB/s per IPU each way (assumption: one DDR4-3200 channel at 80%)",
)
_MK2_SOURCES = ("docs.graphcore.ai IPU-POD DA build and test guide",
                "docs.graphcore.ai ipu-programmers-guide, IPU hardware overview",
                "docs.graphcore.ai bow-2000-datasheet", "thecharlieblake.co.uk/ipus")


def _mk2(name: str, description: str, version: str, machines: int, neighbour: float) -> System:
    """``machines`` IPU-Machines and one host server (an IPU-POD DA system for 4)."""
    n = 4 * machines
    return System(
        name, description, version, n, _ladder(n, neighbour, neighbour),
        _host_links(n, 4, _GATEWAY_BYTES_PER_S, _GATEWAY_LATENCY_S, _GATEWAY),
        _MK2_SOURCES, _MK2_ASSUMPTIONS + (
            ("the machines are cabled into one ladder (a POD16's rails run through its 4 "
             "machines)", "one host server, whose RoCE NICs (2 x 100 GbE) feed all the "
             "machines' gateways: stated (System.host_feed), not charged") if machines > 1 else ()),
        streaming_memory_bytes=_STREAMING_MEMORY_BYTES_PER_IPU,
        streaming_memory_bytes_per_s=_STREAMING_MEMORY_BYTES_PER_S,
        machines=machines, host_server_bytes_per_s=_HOST_NIC_BYTES_PER_S if machines > 1 else 0.0,
    )


_POD_ASSUMPTIONS = (
    "a Pod64 is one IPU-Link torus: its 16 machines' IPUs form a ladder (IPU 2k and 2k+1 "
    "joined, IPU i and i+2 joined) whose ends loop round (the datasheets' 2D-torus IPU-Link "
    "topology; GCL's torus), each IPU's links shared evenly by its 3 neighbours",
    "Pod64s are joined by GW-Links only (no IPU-Link crosses two Pod64s): each machine moves "
    f"{_GW_MACHINE_BYTES_PER_S / 1e9:g} GB/s each way to other pods, the smaller of its "
    f"{_GW_LINK_PORTS} x 100 Gbit/s GW-Links at {_GW_LINK_EFFICIENCY:.0%} efficiency and the "
    "gateway's PCIe Gen4 x8 to its IPUs (a secondary source), shared evenly by its 4 IPUs",
    f"one GW-Link transfer costs {_GW_LINK_LATENCY_S * 1e6:g} us (RoCE through two gateways); "
    "switched GW-Links (Bow Pod256) are charged as direct ones (the switch adds no limit)",
    f"{_HOSTS_PER_POD64} host server per Pod64 (the datasheets' default of 1 to 4; the MLPerf "
    "runs' n_hosts: 1, 2, 4 on Pod64, Pod128, Pod256), whose RoCE NICs (2 x 100 GbE, "
    f"{_HOST_NIC_BYTES_PER_S / 1e9:g} GB/s each way) feed all its machines' gateways: stated "
    "(System.host_feed), not charged",
)
_POD_SOURCES = ("docs.graphcore.ai ipu-pod64-datasheet, ipu-pod128-datasheet, "
                "bow-pod256-datasheet (Pod64 = 16 machines, 2D-torus IPU-Links, 1-4 hosts; "
                "Pod128 = 2 Pod64s, Pod256 = 4, joined by GW-Links)",
                "docs.graphcore.ai switched-gwlinks (GW-Links east/west between racks)",
                "docs.graphcore.ai bow-2000-datasheet (GW-Link 2 x 100 Gbps)",
                "docs.graphcore.ai IPU-POD DA build and test guide (M2000: 2 GW-Link ports, 100 GbE)",
                "vengineer.hatenablog.com 2023-01-23 (IPU-Gateway to IPUs: PCIe Gen4 x8)",
                "docs.graphcore.ai ipu-pod64-build-test, server configuration (host server RNIC: "
                "single/dual port ConnectX-5 100 Gb/s)")


def _pod(name: str, description: str, version: str, pod64s: int, neighbour: float) -> System:
    """``pod64s`` Pod64s of ``version``: each an IPU-Link torus of 64 IPUs (IPUs 64p ..
    64p + 63), joined by the machines' GW-Links; one gateway host link per machine."""
    per = 4 * _POD64_MACHINES
    links = tuple(Link(link.a + p * per, link.b + p * per, link.bytes_per_s, link.latency_s)
                  for p in range(pod64s) for link in _ladder(per, neighbour, neighbour, ring=True))
    n = per * pod64s
    kind = (f"{_GW_LINK_PORTS} x 100 GbE GW-Links per machine "
            + ("(switched)" if version == "bow" and pod64s > 2 else "(direct cables)"))
    return System(
        name, description, version, n, links,
        _host_links(n, 4, _GATEWAY_BYTES_PER_S, _GATEWAY_LATENCY_S, _GATEWAY),
        _MK2_SOURCES + _POD_SOURCES, _MK2_ASSUMPTIONS + _POD_ASSUMPTIONS,
        streaming_memory_bytes=_STREAMING_MEMORY_BYTES_PER_IPU,
        streaming_memory_bytes_per_s=_STREAMING_MEMORY_BYTES_PER_S,
        machines=_POD64_MACHINES * pod64s, hosts=_HOSTS_PER_POD64 * pod64s,
        host_server_bytes_per_s=_HOST_NIC_BYTES_PER_S,
        pods=tuple(tuple(range(p * per, (p + 1) * per)) for p in range(pod64s)),
        gw_link=GwLink(_GW_LINK_PORTS, _GW_LINK_LINE_BYTES_PER_S, _GW_MACHINE_BYTES_PER_S,
                       _GW_LINK_LATENCY_S, kind),
    )


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System(
        "c2", "one C2 PCIe card: 2 GC2 IPUs", "ipu1", 2,
        (Link(0, 1, _C2_PAIR_BYTES_PER_S, _HOP_LATENCY_S),),
        _host_links(2, 2, _PCIE4_X16_BYTES_PER_S, _PCIE_LATENCY_S, _PCIE),
        ("Jia et al. 2019 (arXiv:1912.03413)", "Louw & McIntosh-Smith 2021"),
    ),
    System(
        "dss8440", "Dell DSS8440: 8 C2 cards, 16 GC2 IPUs (the launch article's server)", "ipu1",
        16, _ladder(16, _C2_PAIR_BYTES_PER_S, _C2_CARD_TO_CARD_BYTES_PER_S),
        _host_links(16, 2, _PCIE4_X16_BYTES_PER_S, _PCIE_LATENCY_S, _PCIE),
        ("the launch article", "Jia et al. 2019",
         "graphcore/tensorflow ipu/config.py, SelectionOrder: the link diagram of a machine "
         "with 8 C2 cards"),
        ("cards are cabled into a ladder, as Graphcore's diagram of 8 C2 cards draws them: "
         "IPU i joined to IPU i+2 by one IPU-Link of 32 GB/s each way",
         "each card has a PCIe Gen4 x16 link of its own to the host"),
    ),
    _mk2("m2000", "IPU-M2000: 4 GC200 IPUs", "ipu2", 1, _GC200_NEIGHBOUR_BYTES_PER_S),
    _mk2("bow2000", "Bow-2000: 4 Bow IPUs", "bow", 1, _BOW_NEIGHBOUR_BYTES_PER_S),
    _mk2("pod16", "IPU-POD16: 4 IPU-M2000, 16 GC200 IPUs, one host", "ipu2", 4,
         _GC200_NEIGHBOUR_BYTES_PER_S),
    _mk2("bow-pod16", "Bow Pod16: 4 Bow-2000, 16 Bow IPUs, one host", "bow", 4,
         _BOW_NEIGHBOUR_BYTES_PER_S),
    _pod("pod64", "IPU-POD64: 16 IPU-M2000, 64 GC200 IPUs in an IPU-Link torus, one host",
         "ipu2", 1, _GC200_NEIGHBOUR_BYTES_PER_S),
    _pod("pod128", "IPU-POD128: 2 IPU-POD64 joined by GW-Links, 128 GC200 IPUs, 2 hosts",
         "ipu2", 2, _GC200_NEIGHBOUR_BYTES_PER_S),
    _pod("pod256", "IPU-POD256: 4 IPU-POD64 joined by GW-Links, 256 GC200 IPUs, 4 hosts",
         "ipu2", 4, _GC200_NEIGHBOUR_BYTES_PER_S),
    _pod("bow-pod64", "Bow Pod64: 16 Bow-2000, 64 Bow IPUs in an IPU-Link torus, one host",
         "bow", 1, _BOW_NEIGHBOUR_BYTES_PER_S),
    _pod("bow-pod128", "Bow Pod128: 2 Bow Pod64 joined by GW-Links, 128 Bow IPUs, 2 hosts",
         "bow", 2, _BOW_NEIGHBOUR_BYTES_PER_S),
    _pod("bow-pod256", "Bow Pod256: 4 Bow Pod64 joined by switched GW-Links, 256 Bow IPUs, "
         "4 hosts", "bow", 4, _BOW_NEIGHBOUR_BYTES_PER_S),
)}


def get_system(name: str) -> System:
    """The system called ``name``; ValueError naming the accepted names otherwise."""
    system = SYSTEMS.get(str(name).lower())
    if system is None:
        raise ValueError(f"Unknown system {name!r}; accepted: {', '.join(sorted(SYSTEMS))}.")
    return system


def plain_system(num_ipus: int, ipu_version: str) -> System:
    """``num_ipus`` IPUs of ``ipu_version`` without a named system (``--ipus N``): linked as
    the version's machines are (C2 cards for GC2, M2000-style ladders for Mk2), one host link
    per card or machine."""
    version = canonical_version(ipu_version)
    if num_ipus < 1:
        raise ValueError(f"A system needs at least one IPU. Received: {num_ipus}")
    if version == "ipu1":
        links = _ladder(num_ipus, _C2_PAIR_BYTES_PER_S, _C2_CARD_TO_CARD_BYTES_PER_S)
        hosts = _host_links(num_ipus, 2, _PCIE4_X16_BYTES_PER_S, _PCIE_LATENCY_S, _PCIE)
    else:
        neighbour = _GC200_NEIGHBOUR_BYTES_PER_S if version == "ipu2" else _BOW_NEIGHBOUR_BYTES_PER_S
        links = _ladder(num_ipus, neighbour, neighbour)
        hosts = _host_links(num_ipus, 4, _GATEWAY_BYTES_PER_S, _GATEWAY_LATENCY_S, _GATEWAY)
    hosts = tuple(HostLink(tuple(i for i in h.ipus if i < num_ipus), h.bytes_per_s, h.latency_s,
                           h.kind) for h in hosts)
    mk2 = version != "ipu1"
    return System(f"{num_ipus}x{version}", f"{num_ipus} {VERSIONS[version].product} IPUs",
                  version, num_ipus, links, hosts,
                  assumptions=("linked as the version's named systems are",),
                  streaming_memory_bytes=_STREAMING_MEMORY_BYTES_PER_IPU if mk2 else 0,
                  streaming_memory_bytes_per_s=_STREAMING_MEMORY_BYTES_PER_S if mk2 else 0.0)
