"""Time of one all-reduce of S bytes on H hosts with L ranks each, per algorithm.

The model is a pipeline bound: an algorithm's time is its per-message latency plus the
slowest of the resources every byte must pass through, each taking its bytes at its own
rate, because pieces stream through all of them at once::

    T = steps x per-step latency + max_r (bytes through r / rate of r)  [+ pipeline fill / drain]

Resources: the host NIC (each way; payload rate = line rate x goodput factor), a rank's
reduction (numpy add), a rank's in-host traffic (shared memory, or TCP loopback for gloo),
a reducer's NIC and a reducer's CPU.  Bytes per host NIC follow DESIGN.md section 7
(:mod:`redsock.bench.bounds`): flat ring 2S(N-1)/N, hierarchical ring 2S(H-1)/H (the ring
over H hosts), flat reducers L*S, hierarchical reducers S (L senders of S/L each; unlike the
bound, also on one worker host, since the reducers are hosts of their own).
Hierarchical algorithms run three phases one after another (in-host reduce-scatter, the
inter-host algorithm on S/L per rank, in-host all-gather), so their phases add up.

Reducers forward a piece only once they hold all of it: the last pieces still cross the NICs
after the upload (drain), and a reducer NIC as loaded as a host's starts only once a first
piece is whole (fill).  An emulated link (the testbed's token bucket, ``Cluster.burst_bytes``)
makes up for idling, up to its burst: a reducer's link for the fill, a host's for the drain
(its next call's upload starts that much ahead).  A real NIC has no such bucket.

Recursive doubling is not pipelined: each of its rounds sends the whole buffer and waits,
so its rounds add up, each bound by the busiest host NIC in that round.

What the model leaves out, on purpose: propagation delay beyond the per-step latency,
congestion and incast losses, stragglers, and the CPU of processes that share too few cores
(the lab's CPU-bound layouts): there it predicts the link-bound time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache

from ..bench.bounds import host_nic_bytes
from ..collectives.server_client import MIN_PIECE_BYTES, PIECES_PER_SERVER
from ..config import Config
from ..errors import ConfigError
from ..server.daemon import WINDOW
from .profile import Profile

__all__ = ["ALGORITHMS", "LABELS", "REDUCER_ALGORITHMS", "Cluster", "Prediction", "applicable", "ddp_step_s",
           "fewest_reducers", "gradient_sync_s", "predict", "predict_all"]

#: Algorithm keys, in display order, with their labels.
LABELS = {
    "gloo": "gloo ring",
    "ring": "redsock ring",
    "rd": "recursive doubling",
    "hring": "hierarchical ring",
    "reducers": "reducers",
    "hreducers": "hierarchical reducers",
}
ALGORITHMS = tuple(LABELS)
REDUCER_ALGORITHMS = ("reducers", "hreducers")
#: The settings a rank runs with by default: its streams per link, its inline threshold.
_DEFAULTS = Config()


@dataclass(frozen=True)
class Cluster:
    """A layout: ``hosts`` x ``ranks_per_host`` ranks, each host one NIC of ``link_bps`` (bits
    per second, each way); ``reducers`` reducer hosts with ``reducer_link_bps`` each (default:
    the workers' rate) on NICs of their own, each with ``reducer_cores`` cores its work spreads
    over (that many ``redsock serve`` processes on the host, or summing threads)."""

    hosts: int
    ranks_per_host: int
    link_bps: float
    reducers: int = 0
    reducer_link_bps: float | None = None
    reducer_cores: int = 1
    #: Bytes a link that sat idle sends at once, beyond its rate: an emulated link's token
    #: bucket (the testbed's tc ``burst``); a real NIC has none (0).
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or self.hosts < 1:
            raise ConfigError(f"hosts must be a whole number >= 1, got {self.hosts!r}")
        if not isinstance(self.ranks_per_host, int) or self.ranks_per_host < 1:
            raise ConfigError(f"ranks per host must be a whole number >= 1, got {self.ranks_per_host!r}")
        if self.world < 2:
            raise ConfigError("an all-reduce needs at least 2 ranks (hosts x ranks per host)")
        if not self.link_bps > 0:
            raise ConfigError(f"link rate must be > 0, got {self.link_bps!r}")
        if not isinstance(self.reducers, int) or self.reducers < 0:
            raise ConfigError(f"reducers must be a whole number >= 0, got {self.reducers!r}")
        if self.reducer_link_bps is not None and not self.reducer_link_bps > 0:
            raise ConfigError(f"reducer link rate must be > 0, got {self.reducer_link_bps!r}")
        if not isinstance(self.reducer_cores, int) or self.reducer_cores < 1:
            raise ConfigError(f"reducer cores must be a whole number >= 1, got {self.reducer_cores!r}")
        if not self.burst_bytes >= 0:
            raise ConfigError(f"burst bytes must be >= 0, got {self.burst_bytes!r}")

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def reducer_bps(self) -> float:
        return self.link_bps if self.reducer_link_bps is None else self.reducer_link_bps

    def with_reducers(self, m: int) -> "Cluster":
        return dataclasses.replace(self, reducers=m)

    def with_hosts(self, h: int) -> "Cluster":
        return dataclasses.replace(self, hosts=h)


@dataclass(frozen=True)
class Prediction:
    algo: str
    nbytes: int
    world: int
    seconds: float
    latency_s: float  #: steps x per-step latency (every phase)
    #: seconds each resource needs for its bytes (the largest of a phase bounds that phase)
    terms: dict[str, float] = field(default_factory=dict)
    nic_bytes: float = 0.0  #: bytes through one worker host's NIC, each way
    #: reducers: seconds the NICs still move the last pieces after the busiest resource is done
    drain_s: float = 0.0

    @property
    def bottleneck(self) -> str:
        """The resource that bounds the time: the largest term, or ``latency``."""
        if not self.terms or self.latency_s >= max(self.terms.values()):
            return "latency"
        return max(self.terms, key=self.terms.__getitem__)

    @property
    def link_share(self) -> float:
        """Fraction of the time the NICs alone account for: the busiest one (a host's or a
        reducer's), and the drain, which is NIC time too."""
        nic = max((v for k, v in self.terms.items() if k.endswith("NIC")), default=0.0)
        return (nic + self.drain_s) / self.seconds if self.seconds else 0.0

    @property
    def algbw_GBps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw_GBps(self) -> float:
        return self.algbw_GBps * 2 * (self.world - 1) / self.world

    def to_json(self) -> dict:
        return {"algo": self.algo, "label": LABELS[self.algo], "bytes": self.nbytes, "world": self.world,
                "seconds": self.seconds, "latency_s": self.latency_s, "bottleneck": self.bottleneck,
                "nic_bytes": self.nic_bytes, "drain_s": self.drain_s, "terms": dict(self.terms),
                "algbw_GBps": self.algbw_GBps, "busbw_GBps": self.busbw_GBps}


def _goodput(bps: float, p: Profile) -> float:
    return bps * p.goodput_factor / 8


def _ring(c: Cluster, s: float, p: Profile, step_s: float, in_host_Bps: float) -> tuple[float, dict, float]:
    """Flat ring over all N ranks, placed consecutively: one ring edge per host crosses the NIC."""
    n, L = c.world, c.ranks_per_host
    per_rank = 2 * s * (n - 1) / n
    nic = host_nic_bytes(s, "ring", n, c.hosts) or 0.0
    terms = {"reduce": s * (n - 1) / n / p.reduce_Bps}
    if nic:
        terms["host NIC"] = nic / _goodput(c.link_bps, p)
    if L > 1:  # an in-host edge: the sender copies in, the receiver copies out
        terms["in-host"] = per_rank / in_host_Bps * (2 if in_host_Bps == p.intra_Bps else 1)
    return 2 * (n - 1) * step_s, terms, nic


@lru_cache(maxsize=4096)
def _rd_crossings(hosts: int, L: int) -> tuple[tuple[int, ...], int]:
    """Recursive doubling on N = hosts x L consecutive ranks: per round, the most ranks of one
    host whose partner is on another host; and the same for the fold-in of ranks >= 2^k."""
    n = hosts * L
    p2 = 1 << (n.bit_length() - 1)
    rounds = []
    mask = 1
    while mask < p2:
        per_host = [0] * hosts
        for r in range(p2):
            if r // L != (r ^ mask) // L:
                per_host[r // L] += 1
        rounds.append(max(per_host))
        mask <<= 1
    fold = [0] * hosts
    for r in range(p2, n):  # r sends to r - p2, and gets the result back from it
        if r // L != (r - p2) // L:
            fold[r // L] += 1
            fold[(r - p2) // L] += 1
    return tuple(rounds), max(fold)


def _recursive_doubling(c: Cluster, s: float, p: Profile) -> tuple[float, dict, float, float]:
    """Rounds add up (each waits for the last); returns (latency, terms, nic bytes, bandwidth time)."""
    rounds, fold = _rd_crossings(c.hosts, c.ranks_per_host)
    g = _goodput(c.link_bps, p)
    nic_total = sum(rounds) * s + 2 * fold * s
    in_host = s / p.intra_Bps if c.ranks_per_host > 1 else 0.0
    reduce = s / p.reduce_Bps
    bw = sum(max(k * s / g, in_host, reduce) for k in rounds)
    steps = len(rounds)
    if fold or c.world != 1 << (c.world.bit_length() - 1):
        steps += 2
        bw += 2 * max(fold * s / g, in_host)
    terms = {"host NIC": nic_total / g, "reduce": len(rounds) * reduce}
    if in_host:
        terms["in-host"] = (len(rounds) + 2) * in_host
    return steps * p.redsock_step_s, terms, nic_total, bw


def _reducers(c: Cluster, s: float, p: Profile, senders_per_host: int, per_sender: float,
              contributions: int, shards: int) -> tuple[float, dict, float, float]:
    """Every sender sends its ``per_sender`` bytes to the reducers once and gets them back once;
    the reducers share ``contributions`` x S bytes each way.  ``shards``: the senders that split
    one rank's streams (the hierarchy's L; 1 for flat ranks, each with streams of its own).
    Returns (latency, terms, nic, drain)."""
    if c.reducers < 1:
        raise ConfigError("the reducer algorithms need --reducers >= 1")
    # Pieces as the workers cut them (server_client.piece_elements); piece i goes to reducer
    # i mod M, so a message of fewer pieces than reducers uses only as many reducers.
    piece = min(p.piece_bytes, max(MIN_PIECE_BYTES, math.ceil(per_sender / (c.reducers * PIECES_PER_SERVER))))
    used = min(c.reducers, math.ceil(per_sender / piece))
    nic = senders_per_host * per_sender
    per_reducer = contributions * s / used
    terms = {
        "host NIC": nic / _goodput(c.link_bps, p),
        "reducer NIC": per_reducer / _goodput(c.reducer_bps, p),
        "reducer CPU": per_reducer * p.reducer_cpu_s_per_byte / c.reducer_cores,
    }
    # Drain: a sender's flows to its reducers share its NIC, so the last piece of every
    # (sender, reducer) pair is complete only when the upload ends, and a reducer forwards a
    # piece only once it has all of it.  Then every reducer still sends its last piece to every
    # sender, and every host receives the last piece of every reducer, each on its own NIC.
    senders = c.hosts * senders_per_host
    drain = max(senders * piece / _goodput(c.reducer_bps, p),
                senders_per_host * used * piece / _goodput(c.link_bps, p))
    # Fill: a host's link carries one piece per stream at once (a piece is one slice; one
    # small enough to go inline takes the connection's one control stream), so a reducer holds
    # its first whole piece only after all of them went out; a reducer NIC as busy as the
    # host's starts that late and never catches up.
    pieces_per_pair = math.ceil(math.ceil(per_sender / piece) / used)
    per_pair = (1 if piece <= _DEFAULTS.inline_bytes
                else min(_streams_per_reducer(shards, c.reducers), WINDOW, pieces_per_pair))
    at_once = senders_per_host * used * per_pair
    fill = at_once * piece / _goodput(c.link_bps, p)
    # A link with a token bucket (the lab's) makes up for idling, up to its burst: a reducer's
    # during the fill, a host's during the drain (its next call's upload starts that far ahead).
    drain = max(drain, max(0.0, fill - c.burst_bytes / _goodput(c.reducer_bps, p))
                + terms["reducer NIC"] - max(terms.values()))
    drain = max(0.0, drain - c.burst_bytes / _goodput(c.link_bps, p))
    return 2 * p.reducer_hop_s, terms, nic, drain


@lru_cache(maxsize=1024)
def _streams_per_reducer(shards: int, reducers: int) -> int:
    """A connection's data streams: a rank's, split among the host's shards, then among the
    reducers, as the ranks split them (Config.sharing_link)."""
    return _DEFAULTS.sharing_link(shards).sharing_link(reducers).nsocks


def _in_host_phases(c: Cluster, s: float, p: Profile) -> tuple[float, float]:
    """In-host phases of the hierarchical algorithms (collectives/hierarchy.py): every rank
    copies its buffer into shared memory, each local rank reduces its 1/L shard from the L
    regions, and after the inter-host step every rank copies the result out.  Returns
    (latency: two synchronisations, bandwidth time)."""
    L = c.ranks_per_host
    if L == 1:
        return 0.0, 0.0
    return 2 * p.redsock_step_s, 2 * s / p.intra_Bps + s * (L - 1) / L / p.reduce_Bps


def predict(algo: str, c: Cluster, nbytes: int, p: Profile) -> Prediction:
    """Predicted time of one all-reduce of ``nbytes`` with ``algo`` (a key of :data:`LABELS`)."""
    if nbytes < 1:
        raise ConfigError(f"bytes must be >= 1, got {nbytes}")
    s = float(nbytes)
    if algo in ("gloo", "ring"):
        # gloo's in-host edges are TCP over loopback; redsock's use shared memory.
        step, in_host = (p.gloo_step_s, p.loopback_Bps) if algo == "gloo" else (p.redsock_step_s, p.intra_Bps)
        lat, terms, nic = _ring(c, s, p, step, in_host)
        return Prediction(algo, nbytes, c.world, lat + max(terms.values()), lat, terms, nic)
    if algo == "rd":
        lat, terms, nic, bw = _recursive_doubling(c, s, p)
        return Prediction(algo, nbytes, c.world, lat + bw, lat, terms, nic)
    if algo == "reducers":
        lat, terms, nic, drain = _reducers(c, s, p, c.ranks_per_host, s, c.world, 1)
        return Prediction(algo, nbytes, c.world, lat + max(terms.values()) + drain, lat, terms, nic, drain)
    if algo in ("hring", "hreducers"):
        L = c.ranks_per_host
        lat_in, t_in = _in_host_phases(c, s, p)
        if algo == "hring":
            # L rings of H ranks (one per local rank, each on its S/L share) share the host NIC:
            # together they move what one ring of H ranks on S would.
            lat, terms, nic, t_mid, drain = 0.0, {}, 0.0, 0.0, 0.0
            if c.hosts > 1:
                lat, terms, nic = _ring(Cluster(c.hosts, 1, c.link_bps), s, p, p.redsock_step_s, p.intra_Bps)
                terms["reduce"] /= L
                t_mid = max(terms.values())
        else:
            lat, terms, nic, drain = _reducers(c, s, p, L, s / L, c.hosts, L)
            t_mid = max(terms.values()) + drain
        if L > 1:
            terms["in-host"] = t_in
        latency = lat + lat_in
        return Prediction(algo, nbytes, c.world, latency + t_mid + t_in, latency, terms, nic, drain)
    raise ConfigError(f"unknown algorithm {algo!r}; choose from {', '.join(ALGORITHMS)}")


def applicable(algo: str, c: Cluster) -> bool:
    """Reducer algorithms need reducers; hierarchical ones differ from flat only with L > 1."""
    if algo in REDUCER_ALGORITHMS and c.reducers < 1:
        return False
    if algo in ("hring", "hreducers") and c.ranks_per_host == 1:
        return False
    return True


def predict_all(c: Cluster, nbytes: int, p: Profile) -> list[Prediction]:
    return [predict(a, c, nbytes, p) for a in ALGORITHMS if applicable(a, c)]


def fewest_reducers(algo: str, c: Cluster, nbytes: int, p: Profile, within: float = 0.01,
                    limit: int = 1 << 20) -> tuple[int, Prediction]:
    """The fewest reducers with which ``algo`` is within ``within`` (a fraction) of its best time.
    Time is not monotone in M: more reducers share the bytes, but each holds a last piece to
    drain, and pieces shrink towards MIN_PIECE_BYTES (or the profile's smaller cap), so every M
    up to one piece per reducer (beyond it nothing changes) is tried."""
    if algo not in REDUCER_ALGORITHMS:
        raise ConfigError(f"{algo!r} uses no reducers")
    top = max(1, min(limit, math.ceil(nbytes / min(p.piece_bytes, MIN_PIECE_BYTES))))
    preds = [predict(algo, c.with_reducers(m), nbytes, p) for m in range(1, top + 1)]
    goal = min(q.seconds for q in preds) * (1 + within) * (1 + 1e-12)
    m = next(m for m, q in enumerate(preds, 1) if q.seconds <= goal)
    return m, preds[m - 1]


def ddp_step_s(comm_s: float, compute_s: float, overlap: float) -> float:
    """One training step: compute and gradient all-reduces, ``overlap`` in [0, 1] of the shorter
    hidden behind the longer (DDP overlaps buckets with the backward pass; 0 = none)."""
    if not 0 <= overlap <= 1:
        raise ConfigError(f"overlap must be in [0, 1], got {overlap}")
    return max(comm_s, compute_s) + (1 - overlap) * min(comm_s, compute_s)


def gradient_sync_s(algo: str, c: Cluster, model_bytes: int, bucket_bytes: int, p: Profile) -> float:
    """All-reduces of one step's gradients in DDP buckets of ``bucket_bytes``."""
    if bucket_bytes < 1:
        raise ConfigError("bucket size must be >= 1 byte")
    full, rest = divmod(model_bytes, bucket_bytes)
    t = full * predict(algo, c, bucket_bytes, p).seconds if full else 0.0
    return t + (predict(algo, c, rest, p).seconds if rest else 0.0)

