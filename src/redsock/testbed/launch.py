"""Starting and watching processes in the emulated cluster's hosts (the testbed benchmarks' launcher).

Reducers (``redsock serve``) on the reducer hosts, torchrun-style ranks on the
worker hosts (one or several per host, rank 0's output relayed live), waiting
with a deadline that names the process that failed, stopping everything; plus
the hosts' TCP congestion control and their TCP retransmission counters, and the
signal guards that keep a testbed from being left behind.  The worker programs are
started as commands (``python -m redsock ...``), never imported.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import RedsockError
from . import netns as nx
from .cluster import RankSlot, Testbed

MASTER_PORT = 29500
SERVER_PORT = 7700
SERVER_START_S = 30.0


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[Any]
    log: Path
    info: dict[str, Any] = field(default_factory=dict)


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def set_congestion_control(tb: Testbed, name: str | None) -> str:
    """Set (when ``name``) and read back net.ipv4.tcp_congestion_control of every host namespace."""
    seen = set()
    for host in tb.hosts:
        if name:
            nx.run(["ip", "netns", "exec", tb.ns(host), "sysctl", "-q", "-w",
                    f"net.ipv4.tcp_congestion_control={name}"])
        seen.add(nx.run(["ip", "netns", "exec", tb.ns(host), "sysctl", "-n",
                         "net.ipv4.tcp_congestion_control"]).stdout.strip())
    return ",".join(sorted(seen))


#: TCP counters a benchmark reports per run: a retransmission timeout (TCPTimeouts) stalls
#: a flow for at least 200 ms, which shows in a run's time.
TCP_KEYS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "TCPSpuriousRTOs")


def tcp_counters(tb: Testbed) -> dict[str, int]:
    """TCP retransmission counters summed over the hosts' namespaces (/proc/net/snmp, netstat)."""
    total = dict.fromkeys(TCP_KEYS, 0)
    for name in tb.hosts:
        try:
            text = tb.exec(name, ["cat", "/proc/net/snmp", "/proc/net/netstat"], capture_output=True,
                           text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        lines = text.splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):  # "Tcp: names..." / "Tcp: values..."
            for k, v in zip(head.split()[1:], vals.split()[1:]):
                if k in total and v.lstrip("-").isdigit():
                    total[k] += int(v)
    return total


def tcp_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in TCP_KEYS}


def tcp_line(delta: dict[str, int]) -> str:
    """``RetransSegs 12, TCPTimeouts 0, ...`` for a :func:`tcp_delta`."""
    return ", ".join(f"{k} {v}" for k, v in delta.items())


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    src = str(Path(__file__).resolve().parents[2])  # .../src, so an uninstalled tree works too
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the machine's cores
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_servers(tb: Testbed, logdir: Path, deadline: float) -> list[Proc]:
    servers = []
    for name in tb.server_names:
        log = logdir / f"{name}.log"
        argv = [sys.executable, "-m", "redsock", "serve", "--host", tb.host_addr(name), "--port", str(SERVER_PORT)]
        with log.open("w") as f:
            proc = tb.popen(name, argv, stdout=subprocess.PIPE, stderr=f, text=True,
                            env=child_env({"REDSOCK_BIND_ADDR": tb.host_addr(name)}), start_new_session=True)
        servers.append(Proc(name, proc, log))
    for s in servers:  # wait for each "redsock reduction server on ..." line
        got: dict[str, str] = {}

        def read(p: subprocess.Popen[Any] = s.proc) -> None:
            got["line"] = p.stdout.readline() if p.stdout else ""

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(max(1.0, min(SERVER_START_S, deadline - time.monotonic())))
        if not got.get("line", "").startswith("redsock reduction server on"):
            raise RedsockError(f"reduction server on {s.name} did not start: {got.get('line', '')!r}; "
                               f"log: {tail(s.log) or '(empty)'}")
    return servers


def _relay(stream: IO[str], sink: IO[str], copy: IO[str]) -> None:
    for line in stream:
        sink.write(line)
        sink.flush()
        copy.write(line)
    copy.flush()


def rank_env(tb: Testbed, slot: RankSlot, world: int, master_port: int = MASTER_PORT) -> dict[str, str]:
    """The torchrun variables of one rank (the store on rank 0's host, w0), the reducers'
    addresses and the interface gloo must use."""
    env = {"RANK": str(slot.rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(slot.local_rank),
           "LOCAL_WORLD_SIZE": str(slot.local_world), "MASTER_ADDR": tb.host_addr("w0"),
           "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": tb.host(slot.host).dev}
    if tb.server_names:
        env["REDSOCK_SERVERS"] = ",".join(f"{tb.host_addr(s)}:{SERVER_PORT}" for s in tb.server_names)
    return env


def rank0_output(tb: Testbed, logdir: Path, ranks_per_host: int = 1, tag: str = "") -> Path:
    """Where :func:`start_ranks` copies rank 0's stdout."""
    return logdir / f"{tb.rank_slots(ranks_per_host)[0].label}{tag}.log"


def start_ranks(tb: Testbed, cmd: list[str], logdir: Path, extra_env: dict[str, str] | None = None,
                 master_port: int = MASTER_PORT, tag: str = "", ranks_per_host: int = 1
                 ) -> tuple[list[Proc], list[threading.Thread]]:
    """Run ``cmd`` as ``ranks_per_host`` torchrun-style ranks on every worker host,
    numbered as torchrun numbers them (host w<i> runs ranks i*L .. i*L+L-1).

    Rank 0's stdout is relayed live to ours and copied to :func:`rank0_output`; every
    other output goes to ``logdir/<label><tag>.log`` (label ``w1``, or ``w1.0``, ``w1.1``
    with several ranks per host)."""
    ranks, relays = [], []
    slots = tb.rank_slots(ranks_per_host)
    for slot in slots:
        env = {**rank_env(tb, slot, len(slots), master_port), **(extra_env or {})}
        name = slot.label
        log = logdir / f"{name}{tag}.log"
        if slot.rank == 0:  # stdout live to ours (the tables); stderr into its log
            err = (logdir / f"{name}{tag}.err").open("w")
            proc = tb.popen(slot.host, cmd, env=child_env(env), stdout=subprocess.PIPE, stderr=err, text=True,
                            start_new_session=True)
            err.close()
            copy = log.open("w")
            t = threading.Thread(target=_relay, args=(proc.stdout, sys.stdout, copy), daemon=True)
            t.start()
            relays.append(t)
            ranks.append(Proc(name, proc, logdir / f"{name}{tag}.err"))
        else:
            with log.open("w") as f:
                proc = tb.popen(slot.host, cmd, env=child_env(env), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
            ranks.append(Proc(name, proc, log))
    return ranks, relays


def wait_ranks(ranks: list[Proc], servers: list[Proc], deadline: float, timeout: float) -> str | None:
    """Wait for every rank; return why it stopped early (None when all exited)."""
    while True:
        codes = [p.proc.poll() for p in ranks]
        if all(c is not None for c in codes):
            return None
        failed = [p for p, c in zip(ranks, codes) if c not in (None, 0)]
        if failed:
            # The others are blocked on the failed peer (or about to report it): give them a
            # moment to say so, then stop them.
            end = time.monotonic() + 5.0
            while time.monotonic() < end and any(p.proc.poll() is None for p in ranks):
                time.sleep(0.1)
            return f"rank {ranks.index(failed[0])} ({failed[0].name}) exited with {failed[0].proc.returncode}"
        dead = [s for s in servers if s.proc.poll() is not None]
        if dead:
            return f"reduction server on {dead[0].name} exited with {dead[0].proc.returncode}"
        if time.monotonic() > deadline:
            return f"ranks still running after --timeout {timeout:.0f}s"
        time.sleep(0.1)


def stop(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in procs:
        try:
            p.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(timeout=5)


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP raise KeyboardInterrupt, so the testbed's ``finally`` runs for them too."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        for s in old:
            signal.signal(s, handler)
    try:
        yield
    finally:
        if in_main:
            for s, h in old.items():
                signal.signal(s, h)


@contextmanager
def no_interrupts() -> Iterator[None]:
    """Hold off Ctrl-C / SIGTERM while tearing down, so a second one cannot leave namespaces."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
