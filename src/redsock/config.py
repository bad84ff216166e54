"""Options of redsock: frozen dataclasses, read from ``REDSOCK_*`` variables.

:func:`Config.from_env` is the only place in redsock that reads the
environment; everything else receives a :class:`Config`.  Every field can also
be given as a keyword argument, which wins over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
#: REDSOCK_PIECE_BYTES' floor: smaller pieces would cost more per byte than they pipeline.
SMALLEST_PIECE_BYTES = 4 * KiB
GiB = 1024 * MiB

MAX_NSOCKS = 16
LOCAL_CHUNK_BYTES = 4 * MiB  # slice size floor of the same-host profile (Config.local_nsocks)
BALANCES = ("dynamic", "static")
ALGOS = ("auto", "ring", "small", "server", "hier")
FALLBACKS = ("none", "ring")
SWITCHES = ("auto", "off")
WIRE_DTYPES = ("off", "bf16", "fp16")

#: Every option is the variable ``ENV_PREFIX + FIELD.upper()`` (see :func:`env_var`).
ENV_PREFIX = "REDSOCK_"

#: Variables that are not a Config field, and what they do. The docs' reference lists them with
#: the fields (``redsock.reference``), and a test fails when src/ mentions a REDSOCK_* name that
#: is in neither: a new variable is documented where it is defined.
OTHER_VARIABLES = {
    "REDSOCK_TOKEN_FILE": "File whose contents (stripped) are the shared secret, when REDSOCK_TOKEN is unset "
                          "(what `redsock serve --token-file` reads, and Kubernetes mounts from a Secret).",
    "REDSOCK_SOAK_REDUCER_PIDS": "Internal: `redsock bench soak` passes its reducers' pids to its worker "
                                 "processes this way (to sample their memory); not an option.",
}


def env_var(name: str) -> str:
    """The variable of the Config field ``name``: ``"piece_bytes"`` -> ``"REDSOCK_PIECE_BYTES"``."""
    return ENV_PREFIX + name.upper()


@dataclass(frozen=True)
class Config:
    """All tunables; defaults are the measured ones (every one: docs/reference/environment.md)."""

    #: TCP data streams per connection (plus one control stream). Connections that share a host link
    #: split them: a rank's connections to M reducers get nsocks // M each, a host's L shards between
    #: hosts nsocks // L each (at least 1).
    nsocks: int = 4
    #: Data streams to a peer on this same host (loopback, or this host's own address), which
    #: then also get whole slices of at least LOCAL_CHUNK_BYTES and no TCP_NOTSENT_LOWAT: there
    #: is no network path to balance, and fewer, larger system calls leave the CPU to the
    #: kernel's copies (4 ranks on loopback: 4 MiB all-reduce 13.0 -> 9.0-9.6 ms, 64 MiB 123 -> 99-107 ms).
    #: 0: treat such a peer like any other (nsocks streams).
    local_nsocks: int = 1
    #: Slice size for messages on the data streams.
    chunk_bytes: int = 512 * KiB
    #: Messages up to this size go inline on the control stream from the caller's thread (both
    #: sides use the smaller of their two values).
    inline_bytes: int = 64 * KiB
    #: How long a receiver busy-polls the control stream (yielding the CPU) before it blocks; it does
    #: not spin while its recent answers took longer than this (more ranks than cores).
    spin_us: int = 100
    #: Use MSG_ZEROCOPY for sends of at least this many bytes (0 = off).
    zerocopy_min_bytes: int = 0
    #: SO_BUSY_POLL on the control stream, in microseconds (0 = off).
    busy_poll_us: int = 0
    #: "dynamic": slices go to whichever stream has room; "static": even split (NCCL socket).
    balance: str = "dynamic"
    #: TCP_NOTSENT_LOWAT on data streams so queue occupancy follows real speed (0 = kernel default;
    #: never on a connection with a single data stream, see :meth:`for_peer`).
    #: Small, so a stream that falls behind holds few unsent bytes (testbed ring at 1 Gbit/s,
    #: 1 MiB steps over 4 streams: p90 10 ms at 32 KiB against 20 ms at 256 KiB; bound 8.8).
    notsent_lowat: int = 32 * KiB
    #: Deadline for an operation that makes no progress (it fails and aborts its connection), and
    #: for connecting and rendezvous. torch's ``timeout=`` of init_process_group / new_group sets
    #: it per group, an options object's ``timeout`` per call.
    timeout_s: float = 120.0
    #: Largest single message accepted from the network (validates header fields).
    max_message_bytes: int = 64 * GiB
    #: Address to listen on and advertise to the other ranks (default: the one that routes to
    #: MASTER_ADDR).
    bind_addr: str | None = None
    #: Network interface whose IPv4 address to listen on and advertise (instead of bind_addr).
    ifname: str | None = None
    #: All-reduce algorithm: auto, ring, small (latency-optimised), server, or hier (shared memory
    #: inside each host, then ring/small/server between hosts).
    algo: str = "auto"
    #: Shared memory among the ranks of one host: "auto" (used whenever a host runs several
    #: ranks) or "off" (every collective over Fast Socket).
    shm: str = "auto"
    #: Large all-reduces on one host read and write the peers' buffers directly, one copy each
    #: way (Linux cross-memory attach, ``process_vm_readv``/``writev``): "auto" (where the kernel
    #: allows it; else through the arena) or "off" (through the shared arena, one copy more).
    #: Above the whole-buffer size, whenever it has been faster than the arena lately, starting
    #: so from 512 KiB (``hierarchy.CMA_MIN_BYTES``).  The gain depends on the CPU: 4 ranks on a
    #: 2-core Xeon, 16 MiB took 6.7-7.7 ms against the arena's 11.4-11.7; on a 2-core AMD EPYC
    #: the arena was as fast or faster (1 MiB 664 us against 1068, 2 MiB 1017 against 1841).
    shm_cma: str = "auto"
    #: Hierarchical collectives across hosts (reduce inside each host over shared memory, one
    #: shard per local rank between hosts): "auto" (whenever a host runs several ranks) or "off"
    #: (flat algorithms between hosts; a single-host job still uses shared memory).
    hierarchy: str = "auto"
    #: Reduction servers, "host:port" each: all-reduces of 64 KiB or more go through them (with
    #: algo auto), each worker sending S bytes and receiving S bytes.
    servers: tuple[str, ...] = ()
    #: Largest piece of an all-reduce sent to a reduction server (a smaller message is cut into 16
    #: pieces per server, >= 64 KiB each). Smaller pieces keep links busier, larger ones cost less
    #: CPU: raise it where CPUs, not links, are busy (the testbed at 1 Gbit/s:
    #: 256 KiB pieces kept the reducers' links 84-92% busy, 1 MiB pieces 67-86%, with tail drops).
    piece_bytes: int = 256 * KiB
    #: Wire type of float32 sum/avg all-reduces: "bf16" or "fp16" round each contribution to
    #: 16 bits once (round to nearest even) and sum in float32, so half the bytes cross the
    #: links; "off" sends float32 (results bitwise as without the option).  Other dtypes and
    #: ops always travel as they are.  Also per call: ``all_reduce(x, wire_dtype="bf16")``.
    wire_dtype: str = "off"
    #: Sum contributions in rank order so results repeat bitwise from run to run.
    deterministic: bool = False
    #: What to do when a reduction server fails mid-operation: "none" (raise PeerFailure) or "ring"
    #: (the ranks agree, redo the call by ring all-reduce and warn; a restarted reducer is used again).
    server_fallback: str = "none"
    #: Shared secret for the HMAC challenge-response of every stream's handshake (unset: no
    #: authentication); the secret never crosses the wire. See also REDSOCK_TOKEN_FILE.
    token: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(1 <= self.nsocks <= MAX_NSOCKS, f"nsocks must be 1..{MAX_NSOCKS}, got {self.nsocks}")
        check(0 <= self.local_nsocks <= MAX_NSOCKS, f"local_nsocks must be 0..{MAX_NSOCKS}, got {self.local_nsocks}")
        check(4 * KiB <= self.chunk_bytes <= 256 * MiB, f"chunk_bytes must be 4 KiB..256 MiB, got {self.chunk_bytes}")
        check(0 <= self.inline_bytes <= 1 * MiB, f"inline_bytes must be 0..1 MiB, got {self.inline_bytes}")
        check(self.spin_us >= 0, f"spin_us must be >= 0, got {self.spin_us}")
        check(self.zerocopy_min_bytes >= 0, "zerocopy_min_bytes must be >= 0")
        check(self.busy_poll_us >= 0, "busy_poll_us must be >= 0")
        check(self.balance in BALANCES, f"balance must be one of {BALANCES}, got {self.balance!r}")
        check(self.notsent_lowat >= 0, "notsent_lowat must be >= 0")
        check(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        check(self.max_message_bytes > 0, "max_message_bytes must be > 0")
        check(self.algo in ALGOS, f"algo must be one of {ALGOS}, got {self.algo!r}")
        check(self.piece_bytes >= SMALLEST_PIECE_BYTES, f"piece_bytes must be >= {SMALLEST_PIECE_BYTES // KiB} KiB, got {self.piece_bytes}")
        check(self.shm in SWITCHES, f"shm must be one of {SWITCHES}, got {self.shm!r}")
        check(self.shm_cma in SWITCHES, f"shm_cma must be one of {SWITCHES}, got {self.shm_cma!r}")
        check(self.hierarchy in SWITCHES, f"hierarchy must be one of {SWITCHES}, got {self.hierarchy!r}")
        check(self.wire_dtype in WIRE_DTYPES, f"wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        check(self.server_fallback in FALLBACKS, f"server_fallback must be one of {FALLBACKS}")
        for s in self.servers:
            parse_hostport(s)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Build a Config from ``REDSOCK_*`` variables, then apply keyword overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "token":
                continue
            raw = env.get(env_var(f.name))
            if raw is not None and raw != "":
                values[f.name] = _parse(f.name, f.type, raw)
        token = env.get("REDSOCK_TOKEN")
        token_file = env.get("REDSOCK_TOKEN_FILE")
        if token:
            values["token"] = token.encode()
        elif token_file:
            values["token"] = read_token_file(token_file)
        for k, v in overrides.items():
            if k not in cls.__dataclass_fields__:
                raise ConfigError(f"unknown option {k!r}")
            if v is not None:
                values[k] = tuple(v) if k == "servers" and not isinstance(v, str) else v
        if isinstance(values.get("servers"), str):
            values["servers"] = _parse("servers", "tuple", values["servers"])
        if isinstance(values.get("token"), str):
            values["token"] = values["token"].encode()
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def sharing_link(self, connections: int) -> "Config":
        """The settings for each of ``connections`` connections that cross one link: they
        split its ``nsocks`` streams (at least one each), since more flows per link only add
        losses there."""
        return self.replace(nsocks=max(1, self.nsocks // max(1, connections)))

    def for_peer(self, same_host: bool, nstreams: int | None = None) -> "Config":
        """The settings for one connection: the same-host profile (see ``local_nsocks``) when the
        peer is on this host and the profile is on, else these.  ``nstreams``: the connection's
        data streams when the peer chose them (default: ours)."""
        config = self
        if same_host and self.local_nsocks:
            config = self.replace(nsocks=self.local_nsocks, notsent_lowat=0,
                                  chunk_bytes=max(self.chunk_bytes, LOCAL_CHUNK_BYTES))
        if (nstreams or config.nsocks) == 1 and config.notsent_lowat:
            # One stream has nothing to balance: let unsent bytes wait in the kernel, which then
            # wakes the sending thread about once per slice instead of once per notsent_lowat.
            config = config.replace(notsent_lowat=0)
        return config


def read_token_file(path: str | os.PathLike) -> bytes:
    try:
        token = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"cannot read token file {path}: {e.strerror}") from e
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def check_port(host: str, port: int, what: str) -> None:
    """A port to listen on: 0 (any free one) to 65535, else a clear error (the socket module
    would raise OverflowError, which no caller expects)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"cannot {what} on {host}:{port}: a port is 0 (any free one) to 65535")


def parse_hostport(text: str, default_port: int | None = None) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)`` with a clear error."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), ""
    host = host.strip("[]")
    if not port and default_port is not None:
        return host or "127.0.0.1", default_port
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"bad address {text!r}: expected HOST:PORT") from None
    if not host or not 0 < p < 65536:
        raise ConfigError(f"bad address {text!r}: expected HOST:PORT with port 1..65535")
    return host, p


def _parse(name: str, typ: Any, raw: str) -> Any:
    typ = str(typ)
    var = env_var(name)
    try:
        if "tuple" in typ:
            return tuple(s.strip() for s in raw.split(",") if s.strip())
        if "bool" in typ:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "int" in typ and "float" not in typ:
            return parse_size(raw)
        if "float" in typ:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a valid {typ.split('|')[0].strip()}") from None


_UNITS = {"": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB, "g": GiB, "gb": GiB, "gib": GiB}


def parse_size(text: str) -> int:
    """``"512K"``, ``"4MiB"``, ``"1048576"`` -> bytes (binary units)."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):].strip()
    if unit not in _UNITS or not num:
        raise ValueError(text)
    value = float(num) * _UNITS[unit]
    if value != int(value):
        raise ValueError(text)
    return int(value)
