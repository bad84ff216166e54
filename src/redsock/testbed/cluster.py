"""Emulated clusters in Linux network namespaces with rate-shaped links.

Two topologies share one base class (:class:`NetnsTopology`):

:class:`Testbed` — a star.  Workers ``w0..w{N-1}`` and reducers
``s0..s{M-1}`` each live in namespace ``<prefix>-<host>`` with one interface
``eth0``; its veth peer ``veth-<host>`` is a port of bridge ``br0`` in
namespace ``<prefix>-br``, so nothing touches the root namespace's network.
Addresses: workers ``198.18.0.1+i``, reducers ``198.18.0.101+j`` (/24).  Every
host link is shaped in both directions: egress of ``eth0`` (host to network)
and egress of ``veth-<host>`` in the bridge namespace (network to host).

Profiles:

``uniform``      every link direction at ``rate`` (tbf).
``perflow``      every link direction is one htb tree capped at ``rate`` with four
                 path classes of ceil ``rate * (1, .75, .5, .25)`` chosen by
                 source-port bits (:func:`~redsock.testbed.netns.path_class`):
                 ECMP-like imbalance, a flow that hashes onto a slow path is
                 slow although the NIC is not full.
``slow-server``  reducer ``s0`` at ``rate / 2``, every other link at ``rate``.

:class:`PairTestbed` (``Testbed.pair(...)``) — two namespaces ``<prefix>-a``
(198.18.1.1) and ``<prefix>-b`` (198.18.1.2) joined by one veth pair; the
egress of ``a`` has one htb class per given rate picked by source-port bits,
the reverse direction is unshaped unless ``reverse_rate`` is given.

A small JSON state file ``/run/redsock/<prefix>.json`` records the layout so
that another process (the CLI) can :func:`load` it; everything else is read
back from the system.  ``down()`` / :func:`cleanup_prefix` find the
namespaces by prefix alone, so they also clean up after a crashed run.
"""

from __future__ import annotations

import json
import re
import subprocess
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence, TypeVar

from ..errors import ConfigError
from . import netns as nx
from .netns import TestbedError, format_rate, parse_rate, path_class

__all__ = [
    "PROFILES", "PERFLOW_FRACTIONS", "STATE_DIR", "HostLink", "LinkStatus", "HostStatus",
    "TestbedStatus", "NetnsTopology", "RankSlot", "Testbed", "PairTestbed", "cleanup_prefix",
    "list_prefix_netns", "load", "place_ranks",
]

PROFILES = ("uniform", "perflow", "slow-server")
PERFLOW_FRACTIONS = (1.0, 0.75, 0.5, 0.25)
STATE_DIR = Path("/run/redsock")
DEFAULT_PREFIX = "rstb"

HOST_DEV = "eth0"
BRIDGE_DEV = "br0"
CLUSTER_NET = "198.18.0"
PAIR_NET = "198.18.1"
MAX_HOSTS_PER_ROLE = 100  # workers .1-.100, reducers .101-.200 of one /24

# No '-' in a prefix: cleanup matches "<prefix>-*", and with dashes allowed
# prefix "rstb" would also match the namespaces of prefix "rstb-x".
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")


def _check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix):
        raise ConfigError(
            f"bad testbed prefix {prefix!r}: 1-12 lowercase letters/digits starting with a letter"
        )
    return prefix


@dataclass(frozen=True)
class HostLink:
    """One emulated host: its namespace, address and the shaping of its link.

    ``egress`` / ``ingress`` hold the class ceilings in bits/s of the
    host-to-network / network-to-host direction: one entry is a plain rate
    cap, several are path classes picked by source-port bits (see
    :func:`~redsock.testbed.netns.path_class` with ``shift``), empty is unshaped.
    ``egress_total`` / ``ingress_total`` cap the sum of the classes (None: no cap).
    """

    name: str
    role: str              # "worker", "server" or "end" (pair topology)
    ns: str
    addr: str              # without prefix length
    dev: str               # interface inside ``ns``
    peer_ns: str           # namespace holding the other end of the veth
    peer_dev: str
    egress: tuple[int, ...]
    ingress: tuple[int, ...]
    egress_total: int | None = None
    ingress_total: int | None = None
    shift: int = 1

    def class_rate(self, sport: int, direction: str = "egress") -> int | None:
        """Ceiling in bits/s that a flow from source port ``sport`` meets in ``direction``.

        None when that direction is unshaped.
        """
        if direction not in ("egress", "ingress"):
            raise ConfigError(f"direction must be 'egress' or 'ingress', not {direction!r}")
        rates = self.egress if direction == "egress" else self.ingress
        if not rates:
            return None
        return rates[path_class(sport, len(rates), self.shift)] if len(rates) > 1 else rates[0]


@dataclass(frozen=True)
class RankSlot:
    """Where one rank of a job runs: its host and the torchrun variables it gets."""

    rank: int
    host: str
    local_rank: int
    local_world: int

    @property
    def label(self) -> str:
        """``w1`` with one rank per host, ``w1.0``, ``w1.1``, ... with several (log names)."""
        return self.host if self.local_world == 1 else f"{self.host}.{self.local_rank}"


def place_ranks(hosts: Sequence[str], ranks_per_host: int) -> list[RankSlot]:
    """``ranks_per_host`` ranks on every host, numbered as torchrun numbers them: host i runs
    the consecutive ranks i*L .. i*L+L-1, local ranks 0 .. L-1."""
    if ranks_per_host < 1:
        raise ConfigError(f"ranks per host must be >= 1, got {ranks_per_host}")
    if not hosts:
        raise ConfigError("no hosts to place ranks on")
    return [RankSlot(i * ranks_per_host + j, host, j, ranks_per_host)
            for i, host in enumerate(hosts) for j in range(ranks_per_host)]


@dataclass
class LinkStatus:
    """What is really installed on one device (read back from tc)."""

    ns: str
    dev: str
    present: bool
    qdisc: str              # root qdisc kind, "" when the device is missing
    rates: list[int]        # tbf rate, or htb leaf-class ceilings in class order
    total: int | None       # htb parent-class cap, if any
    summary: str


@dataclass
class HostStatus:
    name: str
    role: str
    ns: str
    addr: str
    present: bool           # namespace exists
    addrs: list[str]        # IPv4 addresses actually on the interface
    egress: LinkStatus
    ingress: LinkStatus
    pids: list[int]         # processes running in the namespace


@dataclass
class TestbedStatus:
    """Structured status; ``str(status)`` is the printable form."""

    __test__ = False  # not a pytest class

    prefix: str
    kind: str
    profile: str
    rate: int | None
    hosts: list[HostStatus]
    namespaces: list[str]   # every namespace carrying the prefix, planned or not
    up: bool                # every planned namespace and device is present and shaped

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        head = f"testbed {self.prefix}: {self.kind}"
        if self.profile:
            head += f", profile {self.profile}"
        if self.rate:
            head += f", rate {format_rate(self.rate)}"
        head += ", " + ("up" if self.up else "NOT fully up")
        lines = [head]
        w = max([4] + [len(h.name) for h in self.hosts])
        lines.append(f"  {'host':<{w}}  {'namespace':<16} {'address':<16} "
                     f"{'egress (host->net)':<30} {'ingress (net->host)':<30} procs")
        for h in self.hosts:
            addr = ",".join(h.addrs) if h.addrs else ("-" if not h.present else "(none)")
            lines.append(f"  {h.name:<{w}}  {h.ns:<16} {addr:<16} {h.egress.summary:<30} "
                         f"{h.ingress.summary:<30} {len(h.pids)}")
        extra = sorted(set(self.namespaces) - {h.ns for h in self.hosts})
        if extra:
            lines.append("  other namespaces: " + " ".join(extra))
        return "\n".join(lines)


def list_prefix_netns(prefix: str) -> list[str]:
    """Every namespace named ``<prefix>-*``."""
    _check_prefix(prefix)
    return sorted(ns for ns in nx.list_netns() if ns.startswith(prefix + "-"))


def state_path(prefix: str, state_dir: Path | str = STATE_DIR) -> Path:
    return Path(state_dir) / f"{_check_prefix(prefix)}.json"


def cleanup_prefix(prefix: str, state_dir: Path | str = STATE_DIR) -> list[str]:
    """Delete every ``<prefix>-*`` namespace (killing its processes) and the state file.

    Returns the namespaces removed.  Deleting a namespace deletes the veth ends
    and the bridge inside it, so nothing else is left over.
    """
    nx.require_root("cleaning up a testbed")
    removed = list_prefix_netns(prefix)
    # Kill processes first everywhere, so no process keeps a peer namespace busy.
    for ns in removed:
        nx.kill_netns_procs(ns)
    for ns in removed:
        nx.del_netns(ns)
    try:
        state_path(prefix, state_dir).unlink()
    except FileNotFoundError:
        pass
    return removed


_T = TypeVar("_T", bound="NetnsTopology")


class NetnsTopology(ABC):
    """Common machinery: namespaces by prefix, exec/popen inside them, state, status, cleanup.

    Subclasses fill ``self.hosts`` in ``__init__`` and implement ``_build()``.
    Use as a context manager (``with Testbed(...) as tb:``) to get ``up()`` on
    entry and ``down()`` on exit, also when the body raises.
    """

    kind = "abstract"
    __test__ = False  # "Testbed*" names must not look like pytest test classes

    def __init__(self, prefix: str, shift: int, state_dir: Path | str) -> None:
        self.prefix = _check_prefix(prefix)
        self.shift = shift
        self.state_dir = Path(state_dir)
        self.hosts: dict[str, HostLink] = {}
        self._procs: list[subprocess.Popen[Any]] = []

    # ------------------------------------------------------------- naming

    def ns_name(self, suffix: str) -> str:
        return f"{self.prefix}-{suffix}"

    def host(self, name: str) -> HostLink:
        try:
            return self.hosts[name]
        except KeyError:
            raise ConfigError(
                f"testbed {self.prefix} has no host {name!r}; hosts: {', '.join(self.hosts)}"
            ) from None

    def host_addr(self, name: str) -> str:
        """IPv4 address of host ``name`` (no prefix length)."""
        return self.host(name).addr

    def ns(self, name: str) -> str:
        """Namespace of host ``name``."""
        return self.host(name).ns

    def namespaces(self) -> list[str]:
        """Every namespace this topology creates."""
        return sorted({h.ns for h in self.hosts.values()}
                      | {h.peer_ns for h in self.hosts.values()})

    @property
    def state_file(self) -> Path:
        return state_path(self.prefix, self.state_dir)

    # ------------------------------------------------------------ lifecycle

    def up(self: _T) -> _T:
        """Build the topology from scratch (removing leftovers with the same prefix first).

        Calling ``up()`` again rebuilds it, killing what ran inside.  On any
        failure everything built so far is removed and :class:`TestbedError`
        (or :class:`~redsock.errors.ConfigError`) propagates.
        """
        nx.require_root(f"testbed {self.prefix}")
        self._stop_procs()
        cleanup_prefix(self.prefix, self.state_dir)
        try:
            self._build()
            self._write_state()
        except BaseException:
            cleanup_prefix(self.prefix, self.state_dir)
            raise
        return self

    def down(self) -> list[str]:
        """Kill processes started here or found in the namespaces, delete every namespace.

        Returns the namespaces removed.  Safe to call when nothing is up.
        """
        self._stop_procs()
        return cleanup_prefix(self.prefix, self.state_dir)

    def __enter__(self: _T) -> _T:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @abstractmethod
    def _build(self) -> None:
        """Create this topology's namespaces, links, addresses and shaping."""

    # -------------------------------------------------------------- running

    def netns_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside ``host``'s namespace."""
        if isinstance(argv, str):
            raise ConfigError("argv must be a list of arguments, not a string")
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def exec(self, host: str, argv: Sequence[str],
             **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside ``host``'s namespace to completion (``subprocess.run`` kwargs)."""
        return subprocess.run(self.netns_argv(host, argv), **kwargs)

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace (``subprocess.Popen`` kwargs).

        ``ip netns exec`` execs the command, so the Popen's pid is the command
        itself; ``down()`` terminates it (and anything else in the namespace).
        """
        proc = subprocess.Popen(self.netns_argv(host, argv), **kwargs)
        self._procs = [p for p in self._procs if p.poll() is None]  # forget finished ones
        self._procs.append(proc)
        return proc

    def _stop_procs(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=2.0)
        self._procs.clear()

    # ------------------------------------------------------------ capacity

    def flow_capacity(self, src: str, dst: str, sport: int) -> int | None:
        """Ceiling in bits/s met by one TCP flow ``src -> dst`` from source port ``sport``.

        The minimum over the shaped hops: ``src`` egress and ``dst`` ingress
        (the same class index on both, since both classify on the same port
        bits).  Class ceilings only: flows sharing a link share its total.
        None when the path is unshaped.
        """
        caps = [c for c in (self.host(src).class_rate(sport, "egress"),
                            self.host(dst).class_rate(sport, "ingress")) if c is not None]
        return min(caps) if caps else None

    # --------------------------------------------------------------- status

    def status(self) -> TestbedStatus:
        """Read back from the system what is present: namespaces, addresses, qdiscs, processes."""
        present = list_prefix_netns(self.prefix)
        hosts = []
        ok = bool(self.hosts)
        for h in self.hosts.values():
            here = h.ns in present
            addrs = _ipv4_addrs(h.ns, h.dev) if here else []
            eg = _link_status(h.ns, h.dev, here)
            ing = _link_status(h.peer_ns, h.peer_dev, h.peer_ns in present)
            ok = (ok and here and f"{h.addr}/24" in addrs
                  and _matches(eg, h.egress, h.egress_total)
                  and _matches(ing, h.ingress, h.ingress_total))
            hosts.append(HostStatus(name=h.name, role=h.role, ns=h.ns, addr=h.addr, present=here,
                                    addrs=addrs, egress=eg, ingress=ing,
                                    pids=nx.netns_pids(h.ns) if here else []))
        return TestbedStatus(prefix=self.prefix, kind=self.kind, profile=self._profile_name(),
                             rate=self._nominal_rate(), hosts=hosts, namespaces=present, up=ok)

    def _profile_name(self) -> str:
        return ""

    def _nominal_rate(self) -> int | None:
        return None

    # ---------------------------------------------------------------- state

    @abstractmethod
    def _params(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this topology from its state file."""

    def _write_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {"kind": self.kind, "prefix": self.prefix, "params": self._params(),
                 "hosts": {n: asdict(h) for n, h in self.hosts.items()}}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    # ------------------------------------------------------------- building

    def _add_host_link(self, h: HostLink) -> None:
        """veth between ``h.ns`` and ``h.peer_ns`` (both must exist), address, up, shaping."""
        nx.add_veth(h.ns, h.dev, h.peer_ns, h.peer_dev)
        nx.add_addr(h.ns, h.dev, f"{h.addr}/24")
        nx.link_up(h.ns, h.dev)
        nx.link_up(h.peer_ns, h.peer_dev)
        _shape(h.ns, h.dev, h.egress, h.egress_total, h.shift)
        _shape(h.peer_ns, h.peer_dev, h.ingress, h.ingress_total, h.shift)


def _shape(ns: str, dev: str, rates: tuple[int, ...], total: int | None, shift: int) -> None:
    if not rates:
        return
    if len(rates) == 1 and total is None:
        nx.shape_uniform(ns, dev, rates[0])
    else:
        nx.shape_per_flow(ns, dev, rates, shift=shift, total=total)


class Testbed(NetnsTopology):
    """A star of ``workers`` + ``servers`` hosts around one bridge, links shaped per ``profile``.

    Example::

        with Testbed(workers=4, servers=2, rate="2gbit", profile="uniform") as tb:
            tb.exec("w0", ["ip", "-br", "addr"])
    """

    kind = "cluster"

    def __init__(self, workers: int = 2, servers: int = 0, rate: int | str = "1gbit",
                 profile: str = "uniform", prefix: str = DEFAULT_PREFIX, *, shift: int = 1,
                 state_dir: Path | str = STATE_DIR) -> None:
        super().__init__(prefix, shift, state_dir)
        if profile not in PROFILES:
            raise ConfigError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
        if not (1 <= workers <= MAX_HOSTS_PER_ROLE and 0 <= servers <= MAX_HOSTS_PER_ROLE):
            raise ConfigError(f"need 1-{MAX_HOSTS_PER_ROLE} workers and 0-{MAX_HOSTS_PER_ROLE} "
                              f"servers, got {workers} and {servers}")
        if profile == "slow-server" and servers < 1:
            raise ConfigError("profile 'slow-server' slows reducer s0: needs --servers >= 1")
        self.workers = workers
        self.servers = servers
        self.rate = parse_rate(rate)
        self.profile = profile
        self.bridge_ns = self.ns_name("br")
        names = [(f"w{i}", "worker", f"{CLUSTER_NET}.{1 + i}") for i in range(workers)]
        names += [(f"s{j}", "server", f"{CLUSTER_NET}.{101 + j}") for j in range(servers)]
        for name, role, addr in names:
            rates, total = self._link_rates(name)
            self.hosts[name] = HostLink(
                name=name, role=role, ns=self.ns_name(name), addr=addr, dev=HOST_DEV,
                peer_ns=self.bridge_ns, peer_dev=f"veth-{name}", egress=rates, ingress=rates,
                egress_total=total, ingress_total=total, shift=shift)

    def _link_rates(self, name: str) -> tuple[tuple[int, ...], int | None]:
        if self.profile == "perflow":
            return tuple(int(self.rate * f) for f in PERFLOW_FRACTIONS), self.rate
        if self.profile == "slow-server" and name == "s0":
            return (self.rate // 2,), None
        return (self.rate,), None

    @property
    def worker_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.workers)]

    @property
    def server_names(self) -> list[str]:
        return [f"s{j}" for j in range(self.servers)]

    def rank_slots(self, ranks_per_host: int = 1) -> list[RankSlot]:
        """The job's ranks on the worker hosts, ``ranks_per_host`` each (see :func:`place_ranks`)."""
        return place_ranks(self.worker_names, ranks_per_host)

    def _build(self) -> None:
        nx.add_netns(self.bridge_ns)
        nx.disable_ipv6(self.bridge_ns)
        nx.add_bridge(self.bridge_ns, BRIDGE_DEV)
        for h in self.hosts.values():
            nx.add_netns(h.ns)
            nx.disable_ipv6(h.ns)
            self._add_host_link(h)
            nx.set_master(h.peer_ns, h.peer_dev, BRIDGE_DEV)

    def _params(self) -> dict[str, Any]:
        return {"workers": self.workers, "servers": self.servers, "rate": self.rate,
                "profile": self.profile, "shift": self.shift}

    def _profile_name(self) -> str:
        return self.profile

    def _nominal_rate(self) -> int | None:
        return self.rate

    def __repr__(self) -> str:
        return (f"Testbed(workers={self.workers}, servers={self.servers}, "
                f"rate={format_rate(self.rate)!r}, profile={self.profile!r}, "
                f"prefix={self.prefix!r})")

    @staticmethod
    def pair(rates: Sequence[int | str] = ("800mbit", "600mbit", "400mbit", "200mbit"),
             prefix: str = "rstp", *, shift: int = 1, total: int | str | None = None,
             reverse_rate: int | str | None = None,
             state_dir: Path | str = STATE_DIR) -> "PairTestbed":
        """Two hosts ``a`` → ``b`` on one veth, ``a``'s egress split into per-port classes.

        See :class:`PairTestbed`; call ``up()`` (or use ``with``) to build it.
        """
        return PairTestbed(rates, prefix, shift=shift, total=total, reverse_rate=reverse_rate,
                           state_dir=state_dir)


class PairTestbed(NetnsTopology):
    """Hosts ``a`` (198.18.1.1) and ``b`` (198.18.1.2) joined by one veth pair, no bridge.

    ``a``'s egress has one htb class per entry of ``rates`` (a power-of-two
    count), chosen by ``path_class(sport, len(rates), shift)``; with ``total``
    the classes share a parent capped at ``total``.  ``b``'s egress (ACKs,
    reverse traffic) is unshaped unless ``reverse_rate`` is given.
    ``class_rate(sport)`` is the ceiling met by a stream ``a -> b`` from
    source port ``sport``.
    """

    kind = "pair"

    def __init__(self, rates: Sequence[int | str] = ("800mbit", "600mbit", "400mbit", "200mbit"),
                 prefix: str = "rstp", *, shift: int = 1, total: int | str | None = None,
                 reverse_rate: int | str | None = None,
                 state_dir: Path | str = STATE_DIR) -> None:
        super().__init__(prefix, shift, state_dir)
        self.rates = tuple(parse_rate(r) for r in rates)
        path_class(0, len(self.rates), shift)  # validates count and shift
        self.total = parse_rate(total) if total is not None else None
        self.reverse_rate = parse_rate(reverse_rate) if reverse_rate is not None else None
        rev = (self.reverse_rate,) if self.reverse_rate else ()
        a, b = self.ns_name("a"), self.ns_name("b")
        self.hosts["a"] = HostLink(name="a", role="end", ns=a, addr=f"{PAIR_NET}.1", dev=HOST_DEV,
                                   peer_ns=b, peer_dev=HOST_DEV, egress=self.rates, ingress=rev,
                                   egress_total=self.total, shift=shift)
        self.hosts["b"] = HostLink(name="b", role="end", ns=b, addr=f"{PAIR_NET}.2", dev=HOST_DEV,
                                   peer_ns=a, peer_dev=HOST_DEV, egress=rev, ingress=self.rates,
                                   ingress_total=self.total, shift=shift)

    def class_rate(self, sport: int) -> int:
        """Ceiling in bits/s of the class a stream ``a -> b`` from ``sport`` lands in."""
        return self.rates[path_class(sport, len(self.rates), self.shift)]

    def _build(self) -> None:
        a, b = self.hosts["a"], self.hosts["b"]
        for h in (a, b):
            nx.add_netns(h.ns)
            nx.disable_ipv6(h.ns)
        # One veth: a's eth0 <-> b's eth0.  Shaping a's egress shapes a->b;
        # b's egress (the same veth seen from b) carries b->a.
        self._add_host_link(a)
        nx.add_addr(b.ns, b.dev, f"{b.addr}/24")

    def _params(self) -> dict[str, Any]:
        return {"rates": list(self.rates), "shift": self.shift, "total": self.total,
                "reverse_rate": self.reverse_rate}

    def _profile_name(self) -> str:
        return "classes " + "/".join(_short_rate(r) for r in self.rates)

    def __repr__(self) -> str:
        return (f"PairTestbed(rates={[format_rate(r) for r in self.rates]}, shift={self.shift}, "
                f"prefix={self.prefix!r})")


def load(prefix: str = DEFAULT_PREFIX, state_dir: Path | str = STATE_DIR) -> NetnsTopology:
    """Rebuild the :class:`Testbed` / :class:`PairTestbed` object of a running testbed.

    Reads ``/run/redsock/<prefix>.json`` written by ``up()``; does not touch
    the system.  Raises :class:`TestbedError` when there is no such state.
    """
    path = state_path(prefix, state_dir)
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise TestbedError(f"no testbed with prefix {prefix!r} is up (no state file {path}); "
                           f"start one with `redsock testbed up`") from None
    except (OSError, ValueError) as exc:
        raise TestbedError(f"unreadable testbed state {path}: {exc}") from exc
    p = state.get("params", {})
    tb: NetnsTopology
    if state.get("kind") == "cluster":
        tb = Testbed(p["workers"], p["servers"], p["rate"], p["profile"], prefix,
                     shift=p["shift"], state_dir=state_dir)
    elif state.get("kind") == "pair":
        tb = PairTestbed(p["rates"], prefix, shift=p["shift"], total=p["total"],
                         reverse_rate=p["reverse_rate"], state_dir=state_dir)
    else:
        raise TestbedError(f"testbed state {path} has unknown kind {state.get('kind')!r}")
    return tb


# ---------------------------------------------------------------- read-back

def _ipv4_addrs(ns: str, dev: str) -> list[str]:
    proc = nx.run(["ip", "-n", ns, "-j", "addr", "show", "dev", dev], check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        return []
    out = []
    for link in json.loads(proc.stdout):
        for a in link.get("addr_info", []):
            if a.get("family") == "inet":
                out.append(f"{a['local']}/{a['prefixlen']}")
    return out


def _short_rate(bps: int) -> str:
    return format_rate(bps).replace(" ", "").replace("bit/s", "")


def _link_status(ns: str, dev: str, ns_present: bool) -> LinkStatus:
    missing = LinkStatus(ns=ns, dev=dev, present=False, qdisc="", rates=[], total=None,
                         summary="(missing)")
    if not ns_present:
        return missing
    try:
        qdiscs = nx.qdisc_show(ns, dev)
    except TestbedError:  # device gone
        return missing
    root = next((q for q in qdiscs if q.get("root")), None)
    kind = root["kind"] if root else "none"
    rates: list[int] = []
    total: int | None = None
    if root is not None and kind == "tbf":
        rates = [int(root["options"]["rate"]) * 8]  # tc's JSON reports bytes/s
        summary = f"tbf {_short_rate(rates[0])}"
    elif kind == "htb":
        classes = nx.class_show(ns, dev)
        leaves = sorted((c for c in classes if c["leaf"]),
                        key=lambda c: int(c["classid"].split(":")[1], 16))
        inner = [c for c in classes if not c["leaf"]]
        rates = [c["ceil"] for c in leaves]
        total = inner[0]["ceil"] if inner else None
        summary = "htb " + "/".join(_short_rate(r) for r in rates)
        if total is not None:
            summary += f" cap {_short_rate(total)}"
    else:
        summary = "unshaped" if kind in ("noqueue", "none") else kind
    return LinkStatus(ns=ns, dev=dev, present=True, qdisc=kind, rates=rates, total=total,
                      summary=summary)


def _matches(link: LinkStatus, rates: tuple[int, ...], total: int | None) -> bool:
    if not link.present:
        return False
    if not rates:
        return True

    def close(a: int, b: int) -> bool:  # tc rounds rates to its internal units
        return abs(a - b) <= max(1000, b // 100)

    return (len(link.rates) == len(rates) and all(close(a, b) for a, b in zip(link.rates, rates))
            and (total is None or (link.total is not None and close(link.total, total))))
