"""Rendezvous: find the other ranks through a key-value store and connect to them.

The store is the one torchrun already runs (``torch.distributed.TCPStore`` at
``MASTER_ADDR:MASTER_PORT``), or any object with ``set(key, value)`` and a
blocking ``get(key)``.  Each rank publishes the address of its Listener; a
connection between two ranks is opened lazily, the first time either needs
it, always by the lower rank — both ends of any exchange need the connection,
so the lower one always comes asking and no rank waits for nobody.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from .config import Config
from .errors import ConfigError, PeerFailure, Timeout, TransportError
from .transport import Connection, Listener, connect

#: How long a rank retries a peer that refuses its connection (or its liveness probes, while
#: waiting for it to connect).  A rank publishes its address only once its listener listens,
#: so a refusal means that listener is gone: the peer died or closed its communicator.
#: Retrying until the timeout (torch's default: 30 min) only delayed the PeerFailure; the
#: grace covers a listener whose full queue resets connections (net.ipv4.tcp_abort_on_overflow=1).
REFUSED_RETRY_S = 2.0
#: How often a rank waiting for a lower rank to connect checks that the lower one still listens.
PROBE_EVERY_S = 1.0

_generation = 0  # communicators created by this process; every rank creates them in the same order
_gen_lock = threading.Lock()


class Store(Protocol):
    def set(self, key: str, value: Any) -> None: ...
    def get(self, key: str) -> bytes: ...


def store_from_env(rank: int, world_size: int, timeout_s: float, env: dict[str, str] | None = None) -> Any:
    """Connect to the TCPStore named by ``MASTER_ADDR``/``MASTER_PORT`` (rank 0 hosts it,
    unless torchrun's agent already does)."""
    env = dict(os.environ if env is None else env)
    try:
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ConfigError("MASTER_ADDR and MASTER_PORT must be set (torchrun sets them)") from None
    try:
        from torch.distributed import TCPStore
    except ImportError:
        raise ConfigError("bootstrapping from the environment needs torch (pip install 'redsock[torch]'), "
                          "or pass store= to redsock.init() (redsock.bootstrap.FileStore for one machine)") from None
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    try:
        return TCPStore(host, port, world_size, is_master=(rank == 0 and not agent),
                        timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as e:  # torch raises RuntimeError/DistStoreError
        raise TransportError(f"cannot reach the store at {host}:{port}: {e}", peer=f"{host}:{port}",
                             op="bootstrap") from e


class FileStore:
    """A store in a directory that every rank sees (one machine, or a shared filesystem):
    for jobs without torch's TCPStore, and starting in milliseconds where importing torch
    takes seconds.  A key is a file, written whole and renamed into place, so a reader
    sees all of a value or nothing; :meth:`get` waits for it up to ``timeout_s``."""

    def __init__(self, directory: str | os.PathLike, timeout_s: float = 60.0):
        self.directory = os.fspath(directory)
        self.timeout_s = timeout_s
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, urllib.parse.quote(key, safe=""))

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        delay = 0.001
        while True:
            try:
                with open(self._path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise Timeout(f"file store {self.directory}: key {key!r} not set within {self.timeout_s:g} s",
                                  peer=self.directory, op="store get") from None
                time.sleep(delay)
                delay = min(2 * delay, 0.05)

    def check(self, keys: list[str]) -> bool:
        return all(os.path.exists(self._path(k)) for k in keys)


def local_address(config: Config, toward: str | None) -> str:
    """The address to listen on and advertise: REDSOCK_BIND_ADDR, REDSOCK_IFNAME's, or the
    one the kernel would use to reach ``toward`` (a UDP connect sends nothing)."""
    if config.bind_addr:
        return config.bind_addr
    if config.ifname:
        return interface_address(config.ifname)
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((toward, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return "127.0.0.1"


def interface_address(ifname: str) -> str:
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            raise ConfigError(f"REDSOCK_IFNAME={ifname}: no IPv4 address ({e.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def host_identity() -> str:
    """What the kernel says a host is: its boot id and this process's network and pid
    namespaces (two processes share a host iff all three agree; two testbed namespaces are two
    hosts).  The pid namespace, because local ranks watch each other's processes (pidfds):
    two containers of one pod share a network namespace, not their pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no procfs: every process is a host of its own (no shared memory)
        return f"{socket.gethostname()}/pid{os.getpid()}"
    return f"{boot}/{netns}/{pidns}"


class _ListenerWatch:
    """Whether a peer still listens at its published address, probed at most every
    ``PROBE_EVERY_S`` with a bare TCP connect (the listener drops it quietly).  A refusal
    means its listener is gone (see ``REFUSED_RETRY_S``); a probe that times out or finds
    no route proves nothing, so it only counts refusals."""

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self._address = (host, int(port))
        self._refused_since: float | None = None
        self._next_probe = time.monotonic() + PROBE_EVERY_S

    def refused_for(self) -> float:
        """Seconds this peer has refused every probe (0 while it accepts, or before a probe)."""
        now = time.monotonic()
        if now >= self._next_probe:
            self._next_probe = now + PROBE_EVERY_S
            try:
                socket.create_connection(self._address, timeout=PROBE_EVERY_S).close()
                self._refused_since = None
            except ConnectionRefusedError:
                self._refused_since = self._refused_since or now
            except OSError:
                pass
        return 0.0 if self._refused_since is None else now - self._refused_since


@dataclass(frozen=True)
class Topology:
    """Which ranks share a host, as observed at rendezvous (LOCAL_RANK is not trusted).

    ``hosts``: the ranks of each host in rank order, hosts ordered by their lowest rank.
    A host's ranks need not be consecutive, nor equal in number across hosts.
    """

    rank: int
    hosts: tuple[tuple[int, ...], ...]
    pids: tuple[int, ...]

    @classmethod
    def from_identities(cls, rank: int, idents: list[str], pids: list[int]) -> "Topology":
        groups: dict[str, list[int]] = {}
        for r, ident in enumerate(idents):
            groups.setdefault(ident, []).append(r)
        return cls(rank, tuple(tuple(g) for g in groups.values()), tuple(pids))

    @property
    def host(self) -> int:
        """Index of this rank's host."""
        return next(h for h, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.hosts[self.host]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def shards(self) -> int:
        """Shards a hierarchical all-reduce cuts a buffer into: one per rank of the smallest
        host, owned by local ranks 0..shards-1 of every host."""
        return min(len(h) for h in self.hosts)

    def inter_host_group(self, shard: int) -> tuple[int, ...]:
        """The ranks that own ``shard`` on every host, in host order."""
        return tuple(h[shard] for h in self.hosts)


class PeerTable:
    """Connections of one rank to the others, opened on first use."""

    def __init__(self, rank: int, world_size: int, store: Any, config: Config, *, group: str = "",
                 namespace: str | None = None, advertise_toward: str | None = None):
        """``namespace`` keeps this communicator's store keys apart from others'; by default
        the process's count of communicators, which needs every rank to create them in the
        same order (pass a namespace where only some ranks create one, e.g. subgroups)."""
        global _generation
        self.rank, self.world_size, self.config = rank, world_size, config
        if namespace is None:
            with _gen_lock:
                _generation += 1
                namespace = str(_generation)
        self.group, self.namespace = group, namespace
        self.prefix = f"redsock/{group}/{namespace}/"
        # Handshake names are short (32 bytes on the wire): a digest of the prefix, then the rank.
        self._ident = f"{zlib.crc32(self.prefix.encode()):08x}:r"
        self.store = store
        self._conns: dict[int, Connection] = {}
        self._connecting: dict[int, threading.Lock] = {}  # per higher peer, while connecting
        self._failed_reason: str | None = None
        self._cv = threading.Condition()
        self._closed = False
        host = local_address(config, advertise_toward)
        self.listener = Listener(host, 0, config=config, on_connection=self._accepted)
        store.set(self.prefix + f"addr/{rank}", f"{host}:{self.listener.address[1]}")
        try:
            self.topology = self._exchange_topology()
        except BaseException:
            self.listener.close()
            raise

    def _exchange_topology(self) -> Topology:
        """Every rank publishes its host identity and pid once; all read everyone's."""
        self.store.set(self.prefix + f"host/{self.rank}", f"{os.getpid()} {host_identity()}")
        idents, pids = [], []
        for r in range(self.world_size):
            try:
                value = self.store.get(self.prefix + f"host/{r}")
            except Exception as e:
                raise PeerFailure(f"rank {self.rank}: rank {r} never published its host: {e}", ranks=(r,)) from e
            pid, _, ident = (value.decode() if isinstance(value, bytes) else str(value)).partition(" ")
            pids.append(int(pid))
            idents.append(ident)
        return Topology.from_identities(self.rank, idents, pids)

    def name(self, rank: int) -> str:
        return f"{self._ident}{rank}"

    def _accepted(self, conn: Connection) -> None:
        peer_name = conn.peer.split("@", 1)[0]
        prefix = self._ident
        if not peer_name.startswith(prefix):
            conn.close()  # a stranger, or a rank of another communicator generation
            return
        try:
            peer = int(peer_name[len(prefix):])
        except ValueError:
            conn.close()
            return
        conn.peer = f"rank {peer} ({conn.peer.split('@')[-1]})"
        with self._cv:
            if self._closed or peer in self._conns or not 0 <= peer < self.rank:
                conn.close()
                return
            self._conns[peer] = conn
            self._cv.notify_all()
            failed = self._failed_reason
        if failed is not None:  # arrived after this rank gave up: the peer must hear why
            conn.abort(failed)

    def get(self, peer: int) -> Connection:
        """The connection to ``peer``, opening (or waiting for) it on first use."""
        conn = self._conns.get(peer)
        if conn is not None:
            return conn
        if peer == self.rank or not 0 <= peer < self.world_size:
            raise ConfigError(f"rank {self.rank}: no peer rank {peer} in a world of {self.world_size}")
        if peer > self.rank:
            with self._cv:
                connecting = self._connecting.setdefault(peer, threading.Lock())
            with connecting:  # two threads asking at once must not open two connections
                conn = self._conns.get(peer)
                if conn is not None:
                    return conn
                addr = self._lookup(peer)
                host, _, port = addr.rpartition(":")
                retry_s = min(self.config.timeout_s, REFUSED_RETRY_S)
                try:
                    conn = connect((host, int(port)), config=self.config, name=self.name(self.rank),
                                   peer_name=f"rank {peer} ({addr})", retry_s=retry_s)
                except TransportError as e:
                    if isinstance(e.__cause__, ConnectionRefusedError):
                        raise TransportError(f"connect with rank {peer} ({addr}): refused for {retry_s:g}s: "
                                             "it no longer listens (it exited, or closed its communicator)",
                                             peer=e.peer, op="connect") from e
                    raise
                with self._cv:
                    self._conns[peer] = conn
                    failed = self._failed_reason
            if failed is not None:
                conn.abort(failed)
            return conn
        return self._wait_for(peer)

    def _wait_for(self, peer: int) -> Connection:
        """Wait for the lower rank ``peer`` to connect: up to the timeout, unless it gives up
        (it says so through the store) or its listener is gone (it exited first)."""
        deadline = time.monotonic() + self.config.timeout_s
        address = self._lookup(peer)
        watch = _ListenerWatch(address)
        while True:
            with self._cv:
                if peer not in self._conns:
                    left = deadline - time.monotonic()
                    if self._closed or left <= 0:
                        raise PeerFailure(f"rank {self.rank}: rank {peer} never connected "
                                          f"(in {self.config.timeout_s:g}s)", ranks=(peer,))
                    self._cv.wait(min(left, 0.2))
                if peer in self._conns:
                    return self._conns[peer]
            # (outside the lock: a probe may take a while, and connections arrive under it)
            failure = self.announced_failure()
            if failure is not None:  # it may never connect: it already gave up
                raise TransportError(failure, peer=f"rank {peer}", op="connect")
            if watch.refused_for() > REFUSED_RETRY_S:
                raise PeerFailure(f"rank {self.rank}: rank {peer} ({address}) never connected, and no longer "
                                  "listens: it exited, or closed its communicator", ranks=(peer,))

    def fail(self, reason: str) -> None:
        """This rank gives up: abort every connection with ``reason`` — also ones that finish
        connecting later (a peer waiting on them would otherwise wait for its timeout) —
        and tell ranks not connected yet through the store."""
        with self._cv:
            self._failed_reason = reason
            conns = list(self._conns.values())
        for conn in conns:
            conn.abort(reason)
        self.announce_failure(reason)

    def announce_failure(self, reason: str) -> None:
        """Tell every rank, connected or not yet, that this communicator failed."""
        try:
            self.store.set(self.prefix + "failed", reason)
        except Exception:  # the store may be what failed; the connections carry it too
            pass

    def announced_failure(self) -> str | None:
        key = self.prefix + "failed"
        try:
            if self.store.check([key]):
                value = self.store.get(key)
                return value.decode() if isinstance(value, bytes) else str(value)
        except Exception:
            return None
        return None

    def _lookup(self, peer: int) -> str:
        try:
            value = self.store.get(self.prefix + f"addr/{peer}")
        except Exception as e:
            raise PeerFailure(f"rank {self.rank}: rank {peer} never published its address: {e}",
                              ranks=(peer,)) from e
        return value.decode() if isinstance(value, bytes) else str(value)

    def connections(self) -> dict[int, Connection]:
        with self._cv:
            return dict(self._conns)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
            self._cv.notify_all()
        self.listener.close()
        for c in conns:
            c.close()
