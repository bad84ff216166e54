"""Small, transparent primitives over iproute2 (`ip`, `tc`) for the emulated cluster.

Every helper shells out to the same commands an operator would type, so a
failure message can be pasted back into a terminal.  Any command that fails
raises :class:`TestbedError` carrying the command line and its stderr.

Rates are plain integers in bits per second everywhere in this module; use
:func:`parse_rate` to turn ``"800mbit"`` / ``"2gbit"`` / ``"1G"`` into one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from typing import Any, Sequence

from ..errors import ConfigError, RedsockError

__all__ = [
    "TestbedError", "require_root", "run", "parse_rate", "format_rate",
    "list_netns", "netns_exists", "add_netns", "del_netns", "disable_ipv6", "netns_pids",
    "kill_netns_procs",
    "add_veth", "add_bridge", "set_master", "add_addr", "link_up",
    "clear_root_qdisc", "shape_uniform", "shape_per_flow", "path_class", "port_for_class",
    "qdisc_show", "class_show",
]

# The benchmarking range (RFC 2544).  Refusing anything else keeps emulated
# traffic from ever being routed at a real network.
ALLOWED_NET = ("198.18.", "198.19.")


class TestbedError(RedsockError):
    """A namespace / link / qdisc operation failed (message names the command and its stderr)."""

    __test__ = False  # not a pytest test class despite the name


def require_root(what: str = "the testbed") -> None:
    """Raise :class:`TestbedError` unless running as root (namespaces and tc need CAP_NET_ADMIN)."""
    if os.geteuid() != 0:
        raise TestbedError(
            f"{what} needs root: it creates network namespaces, veth pairs and tc qdiscs, "
            f"which require CAP_NET_ADMIN/CAP_SYS_ADMIN (running as uid {os.geteuid()}); "
            f"re-run with sudo"
        )


def run(argv: Sequence[str], *, timeout: float = 20.0, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (no shell), return the completed process; raise TestbedError on failure.

    ``check=False`` returns a failing process instead of raising (for probes and
    best-effort cleanup).
    """
    cmd = shlex.join(argv)
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              input=input)
    except FileNotFoundError as exc:
        raise TestbedError(f"command not found: {cmd} ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"command timed out after {timeout:g}s: {cmd}") from exc
    if check and proc.returncode != 0:
        raise TestbedError(
            f"command failed (exit {proc.returncode}): {cmd}\n  stderr: {proc.stderr.strip()}"
        )
    return proc


# --------------------------------------------------------------------------- rates

_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")
_RATE_UNITS = {
    "": 1, "bit": 1,
    "k": 10**3, "kbit": 10**3,
    "m": 10**6, "mbit": 10**6,
    "g": 10**9, "gbit": 10**9,
}


def parse_rate(rate: str | int | float) -> int:
    """Parse a link rate into bits per second.

    Accepts numbers (bits/s) and strings ``<number><unit>`` with unit one of
    ``bit, k, kbit, m, mbit, g, gbit`` (case-insensitive, decimal, always *bits*):
    ``"2gbit"``, ``"800mbit"``, ``"1G"``.  Byte units (``bps``, ``MB``) are
    rejected rather than guessed, because tc reads ``bps`` as *bytes* per second.
    """
    if isinstance(rate, bool):
        raise ConfigError(f"bad rate {rate!r}")
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        m = _RATE_RE.match(rate)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _RATE_UNITS:
            raise ConfigError(
                f"bad rate {rate!r}: expected e.g. '2gbit', '800mbit', '1G', '500M' "
                f"(units bit/k/kbit/m/mbit/g/gbit, all in bits per second)"
            )
        value = float(m.group(1)) * _RATE_UNITS[unit]
    if not value >= 1000:
        raise ConfigError(f"rate {rate!r} is below 1 kbit/s; tc cannot shape that")
    return int(round(value))


def format_rate(bps: float) -> str:
    """Human form of a rate in bits/s: ``1.72 Gbit/s``, ``400 Mbit/s``."""
    for div, unit in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= div:
            return f"{bps / div:.3g} {unit}"
    return f"{bps:.0f} bit/s"


# ----------------------------------------------------------------- namespaces

def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = run(["ip", "netns", "list"]).stdout
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_exists(ns: str) -> bool:
    return os.path.exists(f"/run/netns/{ns}") or ns in list_netns()


def add_netns(ns: str) -> None:
    """Create namespace ``ns`` with its loopback up (many tools assume a working ``lo``)."""
    run(["ip", "netns", "add", ns])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def disable_ipv6(ns: str) -> None:
    """Turn IPv6 off in ``ns`` so link-local chatter (RS, MLD) stays out of the shaped queues."""
    if not os.path.isdir("/proc/sys/net/ipv6"):
        return  # kernel without IPv6: nothing to silence
    run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
         "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])


def netns_pids(ns: str) -> list[int]:
    """PIDs of processes whose network namespace is ``ns``."""
    proc = run(["ip", "netns", "pids", ns], check=False)
    if proc.returncode != 0:
        return []
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def kill_netns_procs(ns: str, grace_s: float = 2.0) -> list[int]:
    """SIGTERM every process in ``ns``, SIGKILL what is left after ``grace_s``; return the PIDs.

    The calling process is never signalled, even when it runs inside ``ns``.
    """
    me = os.getpid()
    pids = [p for p in netns_pids(ns) if p != me]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in netns_pids(ns) if p != me]
    for pid in left:
        _signal(pid, signal.SIGKILL)
    # Give the kernel a moment to reap, so a following `ip netns del` really frees the ns.
    deadline = time.monotonic() + grace_s
    while [p for p in netns_pids(ns) if p != me] and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def del_netns(ns: str) -> None:
    """Kill the processes inside ``ns`` and delete it (its veths go with it). No-op if absent."""
    if not netns_exists(ns):
        return
    kill_netns_procs(ns)
    proc = run(["ip", "netns", "del", ns], check=False)
    if proc.returncode != 0 and netns_exists(ns):
        raise TestbedError(
            f"command failed (exit {proc.returncode}): ip netns del {ns}\n"
            f"  stderr: {proc.stderr.strip()}"
        )


# ---------------------------------------------------------------------- links

def add_veth(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    """Create a veth pair with one end ``dev_a`` in ``ns_a`` and the other ``dev_b`` in ``ns_b``.

    Both ends are created directly inside their namespaces, so the root
    namespace never sees (or collides on) the names.
    """
    run(["ip", "link", "add", dev_a, "netns", ns_a, "type", "veth",
         "peer", "name", dev_b, "netns", ns_b])


def add_bridge(ns: str, dev: str) -> None:
    """Create and bring up a Linux bridge ``dev`` in ``ns`` (STP off, no forwarding delay)."""
    run(["ip", "-n", ns, "link", "add", dev, "type", "bridge",
         "stp_state", "0", "forward_delay", "0"])
    link_up(ns, dev)


def set_master(ns: str, dev: str, bridge: str) -> None:
    run(["ip", "-n", ns, "link", "set", dev, "master", bridge])


def add_addr(ns: str, dev: str, cidr: str) -> None:
    """Assign ``cidr`` to ``dev``; only the 198.18.0.0/15 benchmarking range is accepted."""
    if not cidr.startswith(ALLOWED_NET):
        raise ConfigError(f"testbed address {cidr!r} is outside 198.18.0.0/15; refusing")
    run(["ip", "-n", ns, "addr", "add", cidr, "dev", dev])


def link_up(ns: str, dev: str) -> None:
    run(["ip", "-n", ns, "link", "set", dev, "up"])


# -------------------------------------------------------------------- shaping

def clear_root_qdisc(ns: str, dev: str) -> None:
    """Remove the root qdisc of ``dev`` (ignores 'nothing to delete')."""
    run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)


def burst_bytes(rate_bps: int) -> int:
    # veth hands the qdisc GSO super-packets of up to 64 KiB.  A bucket smaller
    # than that makes tbf split every super-packet (CPU-heavy), and a bucket of
    # only a few packets makes the token refill timer-bound; ~2 ms of rate, at
    # least 128 KiB, keeps one TCP flow within a few percent of the rate while
    # the initial burst stays negligible against a 1-2 s measurement.
    return max(128 * 1024, rate_bps // 8 // 500)


def _queue_limit_bytes(rate_bps: int) -> int:
    # Queue ~10 ms at the rate: enough for TCP to keep the link busy (namespace RTTs
    # are tens of microseconds) without building huge latency.  At least 1 MiB, because
    # veth hands the qdisc 64 KiB GSO super-packets: 256 KiB held only 4 of them, so a
    # few flows bursting at once lost 44 MTU packets per drop, where a switch port's
    # buffer (hundreds of KiB to MiBs) holds hundreds of MTU packets.  Measured, 4 hosts
    # x 2 ranks + 4 reducers at 300 Mbit/s: ~2000 drops per link -> ~60 with 1 MiB;
    # gloo's one-flow-per-link ring the same either way (99.6% / 99.5% of its bound).
    return max(1024 * 1024, rate_bps // 8 // 100)


def shape_uniform(ns: str, dev: str, rate: int | str) -> None:
    """Cap the egress of ``dev`` in ``ns`` at ``rate`` (bits/s) with a token bucket (tbf)."""
    bps = parse_rate(rate)
    clear_root_qdisc(ns, dev)
    run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
         "rate", f"{bps}bit", "burst", str(burst_bytes(bps)),
         "limit", str(_queue_limit_bytes(bps))])


def path_class(sport: int, nclasses: int, shift: int = 1) -> int:
    """Index of the path class a packet with source port ``sport`` takes.

    Mirrors the u32 filters of :func:`shape_per_flow`:
    ``(sport >> shift) & (nclasses - 1)``.
    """
    _check_classes(nclasses, shift)
    if not 0 <= sport <= 0xFFFF:
        raise ConfigError(f"source port {sport} out of range")
    return (sport >> shift) & (nclasses - 1)


def port_for_class(cls: int, nclasses: int, shift: int = 1, base: int = 20000) -> int:
    """Smallest port >= ``base`` whose :func:`path_class` is ``cls`` (for binding a client)."""
    _check_classes(nclasses, shift)
    if not 0 <= cls < nclasses:
        raise ConfigError(f"class {cls} out of range for {nclasses} classes")
    port = base
    while path_class(port, nclasses, shift) != cls:
        port += 1
    return port


def _check_classes(nclasses: int, shift: int) -> None:
    if nclasses < 1 or nclasses & (nclasses - 1):
        raise ConfigError(f"number of path classes must be a power of two, got {nclasses}")
    if shift < 1:
        # Linux hands connect() only even ephemeral ports: bit 0 would put every
        # connection into the same half of the classes.
        raise ConfigError("shift must be >= 1: bit 0 of Linux ephemeral ports is always 0")
    if shift + (nclasses.bit_length() - 1) > 16:
        raise ConfigError(f"shift {shift} with {nclasses} classes exceeds the 16-bit port")


def shape_per_flow(ns: str, dev: str, rates: Sequence[int | str], shift: int = 1,
                   total: int | str | None = None) -> None:
    """Split the egress of ``dev`` into ``len(rates)`` htb classes picked by source-port bits.

    Class ``i`` (handle ``1:{10+i}``) never exceeds ``rates[i]`` (its ceil),
    like one ECMP path of that capacity.  A packet goes to class
    ``(sport >> shift) & (len(rates) - 1)`` (see :func:`path_class`); packets
    that are not TCP/UDP over IPv4 (ARP, ICMP) fall into class 0.  The u32
    match reads the port at IP offset 20, i.e. it assumes no IP options, which
    holds for everything the testbed sends.

    With ``total`` the classes hang under one parent class capped at ``total``
    (the NIC): each class is guaranteed its share ``total * rates[i] / sum(rates)``
    and borrows up to ``rates[i]`` while the others leave room.  Without it
    the classes are independent (rate == ceil), so their sum may exceed any
    single rate.
    """
    n = len(rates)
    _check_classes(n, shift)
    ceils = [parse_rate(r) for r in rates]
    cap = parse_rate(total) if total is not None else None
    if cap is not None and cap < sum(ceils):
        guaranteed = [max(1000, cap * c // sum(ceils)) for c in ceils]
    else:
        guaranteed = list(ceils)
    clear_root_qdisc(ns, dev)
    tc = ["tc", "-n", ns]
    run(tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
    parent = "1:"
    if cap is not None:
        burst = str(burst_bytes(cap))
        run(tc + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                  "rate", f"{cap}bit", "ceil", f"{cap}bit", "burst", burst, "cburst", burst,
                  "quantum", str(_quantum(cap))])
        parent = "1:1"
    mask = (n - 1) << shift
    for i, (g, c) in enumerate(zip(guaranteed, ceils)):
        cid = f"1:{10 + i}"
        run(tc + ["class", "add", "dev", dev, "parent", parent, "classid", cid, "htb",
                  "rate", f"{g}bit", "ceil", f"{c}bit",
                  "burst", str(burst_bytes(g)), "cburst", str(burst_bytes(c)),
                  "quantum", str(_quantum(g))])
        # htb's default leaf queue counts *packets* (txqlen); GSO packets are up
        # to 64 KiB, so bound the queue in bytes instead.
        run(tc + ["qdisc", "add", "dev", dev, "parent", cid, "handle", f"{10 + i}:",
                  "bfifo", "limit", str(_queue_limit_bytes(c))])
        if n == 1:
            continue  # the default class already catches everything
        for proto in ("6", "17"):  # TCP and UDP both carry the source port at offset 20
            run(tc + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
                      "prio", "1", "u32",
                      "match", "ip", "protocol", proto, "0xff",
                      "match", "ip", "sport", str(i << shift), hex(mask),
                      "flowid", cid])


def _quantum(rate_bps: int) -> int:
    # Bytes a class may send per round when borrowing: proportional to its rate
    # so borrowed bandwidth is shared by rate, at least one full-size GSO packet
    # and at most htb's 200000 sanity limit (the default r2q=10 overshoots it).
    return max(65536 + 1514, min(200000, rate_bps // 8 // 100))


# ----------------------------------------------------------------- inspection

def qdisc_show(ns: str, dev: str | None = None) -> list[dict[str, Any]]:
    """``tc -j qdisc show [dev DEV]`` in ``ns`` as parsed JSON (rates there are bytes/s)."""
    argv = ["tc", "-n", ns, "-j", "qdisc", "show"]
    if dev is not None:
        argv += ["dev", dev]
    out = run(argv).stdout.strip()
    return json.loads(out) if out else []


_HTB_CLASS_RE = re.compile(
    r"^class htb (?P<classid>\S+) (?:root|parent (?P<parent>\S+))(?P<leaf> leaf \S+)?"
    r".*?\brate (?P<rate>\S+) ceil (?P<ceil>\S+)")


def class_show(ns: str, dev: str) -> list[dict[str, Any]]:
    """htb classes of ``dev`` in ``ns``: classid, parent (None at the root), leaf, rate, ceil.

    Parsed from text: iproute2 6.1 prints htb classes as text even with ``-j``.
    Rates are in bits/s.
    """
    out = run(["tc", "-n", ns, "class", "show", "dev", dev]).stdout
    classes = []
    for line in out.splitlines():
        m = _HTB_CLASS_RE.match(line)
        if m:
            classes.append({"classid": m["classid"], "parent": m["parent"],
                            "leaf": m["leaf"] is not None,
                            "rate": parse_rate(m["rate"]), "ceil": parse_rate(m["ceil"])})
    return classes
