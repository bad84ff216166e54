"""The link bounds of DESIGN.md section 7: bytes through a host's link per byte of all-reduce.

The one place for them: the testbed benchmarks' summaries, ``redsock reproduce`` and the
plan's model (``redsock plan``) all read their bounds here.
"""

from __future__ import annotations

from ..errors import ConfigError

#: Payload goodput of a shaped testbed link as a share of its configured rate
#: (tc counts Ethernet/IP/TCP headers; measured on this testbed at a 1500-byte MTU).
GOODPUT_FACTOR = 0.956

#: How an all-reduce crosses hosts: every rank on its own ("flat"), or reduced inside each
#: host first so that only one shard per rank leaves it ("hierarchical").
SCHEMES = ("flat", "hierarchical")


def host_nic_factor(algo: str, world: int, hosts: int, scheme: str = "flat") -> float | None:
    """Bytes through one host's link, each way, per byte of an all-reduce of ``world`` ranks
    placed consecutively on ``hosts`` hosts, L = world / hosts each (DESIGN.md section 7):

    * ring (gloo's too): flat 2(N-1)/N (of the ring's edges only the one leaving a host
      crosses its link, and every edge carries 2S(N-1)/N); hierarchical 2(H-1)/H (each
      local rank rings its S/L shard over the H hosts);
    * reducers (``server``): flat L (every rank sends S and receives S); hierarchical 1.

    None where there is no closed form (``auto`` / ``small`` choose by size) or no link is
    crossed (one host).
    """
    return host_nic_bytes(1.0, algo, world, hosts, scheme)


def host_nic_bytes(nbytes: float, algo: str, world: int, hosts: int, scheme: str = "flat") -> float | None:
    """Bytes through one host's link, each way, for an all-reduce of ``nbytes``: ``nbytes`` x
    :func:`host_nic_factor`, multiplied out in the order that keeps the plan's figures exact."""
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    if world < 1 or hosts < 1 or world % hosts:
        raise ConfigError(f"{world} ranks do not fill {hosts} hosts evenly")
    if hosts < 2:
        return None
    if algo == "server":
        return nbytes if scheme == "hierarchical" else world // hosts * nbytes
    if algo in ("ring", "gloo"):
        return 2 * nbytes * (hosts - 1) / hosts if scheme == "hierarchical" else 2 * nbytes * (world - 1) / world
    return None


def ideal_over_gloo(algo: str, world: int, hosts: int | None = None, scheme: str = "flat") -> float | None:
    """algbw ratio against gloo's flat ring when both are link-bound: the ratio of the bytes
    their host links carry (:func:`host_nic_factor`; ``hosts`` defaults to one rank per host)."""
    hosts = world if hosts is None else hosts
    mine = host_nic_factor(algo, world, hosts, scheme)
    gloo = host_nic_factor("gloo", world, hosts)
    return gloo / mine if mine and gloo else None


def link_goodput_GBps(rate_bps: float, factor: float = GOODPUT_FACTOR) -> float:
    """Payload GB/s one shaped link direction carries."""
    return rate_bps * factor / 8 / 1e9
