"""``redsock testbed faults``: the fault matrix — every failure ends in a clear error, never a hang.

Algorithms {ring, small, reducers, hierarchical with 2 ranks per host (between hosts by ring, or
through the reducers)} x faults {worker
SIGKILL, worker SIGSTOP, worker host's link down, worker host's link down for 3 s then up,
reducer SIGTERM, reducer SIGKILL, reducer host's link down} (reducer faults where reducers are
used, once more with ``REDSOCK_SERVER_FALLBACK=ring``), on one emulated cluster: worker hosts
``w0..w2`` and reducer host ``s0``.  A cell runs :mod:`redsock.faults.job` on every rank
(repeated all-reduces checked against a closed form), injects the fault once every rank has
finished its first step and a little more, and expects:

* a link flap, or a reducer fault with the ring fallback: right results to the last step on
  every rank;
* anything else: ``PeerFailure`` on every rank still alive, within ``REDSOCK_TIMEOUT_S`` + 5 s
  of the fault, naming the faulty rank(s) (or the reducer's address) and no other;
* and in every cell: no process left in the hosts' namespaces, no new ``/dev/shm`` entry, a
  reducer stopped by SIGTERM exits 0 within 2 s; at the end no namespace left.

A cut-off host's own ranks are alive too: they must name a rank (or the reducer) on the far
side of the cut, never one on their own host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Sequence

from ..bench.procs import box_cpu, cpu_shares
from ..config import parse_size
from ..errors import ConfigError, RedsockError
from ..testbed import netns as nx
from ..testbed.cluster import RankSlot, Testbed, cleanup_prefix, list_prefix_netns, place_ranks
from ..testbed.launch import SERVER_PORT, Proc, child_env, rank_env, start_servers, stop
from ..transport.shm import ARENA_DIR, ARENA_PREFIX

__all__ = ["ALGOS", "FAULTS", "Cell", "Outcome", "add_arguments", "matrix", "run", "run_cell", "run_matrix",
           "table"]

#: (name, all-reduce algorithm of fault_job, float32 elements, ranks per host, worker hosts);
#: ``hier`` goes between hosts by ring, ``hier-reducers`` through the reducer (each local rank
#: sends its 512 KiB shard there).
ALGOS = {
    "ring": ("ring", 256 * 1024, 1, 3),
    "small": ("small", 256, 1, 3),
    "reducers": ("server", 256 * 1024, 1, 3),
    "hier": ("hier", 256 * 1024, 2, 2),
    "hier-reducers": ("hier", 256 * 1024, 2, 2),
}
#: The matrix's algorithms by default (all of them).
DEFAULT_ALGOS = tuple(ALGOS)
USES_REDUCER = ("reducers", "hier-reducers")
WORKER_FAULTS = ("kill", "stop", "link", "flap")
REDUCER_FAULTS = ("srv-term", "srv-kill", "srv-link")
FAULTS = {
    "kill": "worker SIGKILL",
    "stop": "worker SIGSTOP",
    "link": "worker link down",
    "flap": "worker link 3 s down",
    "srv-term": "reducer SIGTERM",
    "srv-kill": "reducer SIGKILL",
    "srv-link": "reducer link down",
}
FLAP_S = 3.0
#: The victim host: w1 (rank 0's host w0 holds the store, which is no part of the test).
VICTIM_HOST = "w1"
REDUCER_HOST = "s0"
#: A SIGTERM'd reducer must be gone within this.
REDUCER_EXIT_S = 2.0
#: The slack the issue allows past the timeout.
GRACE_S = 5.0


@dataclass(frozen=True)
class Cell:
    algo: str
    fault: str
    fallback: bool = False
    hosts: int = 0      # worker hosts; 0: the algorithm's default (ALGOS)
    elements: int = 0   # float32 elements per all-reduce; 0: the algorithm's default

    @property
    def shape(self) -> tuple[int, int]:
        """(float32 elements per all-reduce, worker hosts)."""
        _, count, _, hosts = ALGOS[self.algo]
        return self.elements or count, self.hosts or hosts

    @property
    def name(self) -> str:
        return f"{self.algo}{'+fallback' if self.fallback else ''} / {FAULTS[self.fault]}"

    @property
    def survives(self) -> bool:
        """Training goes on: a flap, or a reducer fault that the ring fallback absorbs."""
        return self.fault == "flap" or (self.fallback and self.fault in REDUCER_FAULTS)

    def slots(self) -> list[RankSlot]:
        _, _, per_host, _ = ALGOS[self.algo]
        return place_ranks([f"w{i}" for i in range(self.shape[1])], per_host)

    def victims(self) -> list[int]:
        """The ranks the fault takes out: the victim host's first rank for a process fault, all of
        its ranks for a link fault, none for a reducer fault."""
        on_host = [s.rank for s in self.slots() if s.host == VICTIM_HOST]
        if self.fault in ("kill", "stop"):
            return on_host[:1]
        return on_host if self.fault == "link" else []


def matrix(algos: Sequence[str] = DEFAULT_ALGOS, faults: Sequence[str] = tuple(FAULTS), hosts: int = 0,
           elements: int = 0) -> list[Cell]:
    """The cells for ``algos`` x ``faults``: reducer faults only with reducers, and those once
    without and once with the ring fallback.  ``hosts``/``elements``: another shape than the
    algorithms' own (0: theirs)."""
    if hosts and hosts < 2:
        raise ConfigError(f"--hosts must be at least 2 (the victim is w1), got {hosts}")
    cells = []
    for a in algos:
        if a not in ALGOS:
            raise ConfigError(f"unknown algorithm {a!r}; one of {', '.join(ALGOS)}")
        for f in faults:
            if f not in FAULTS:
                raise ConfigError(f"unknown fault {f!r}; one of {', '.join(FAULTS)}")
            if f in REDUCER_FAULTS and a not in USES_REDUCER:
                continue
            cells.append(Cell(a, f, hosts=hosts, elements=elements))
    cells += [Cell(c.algo, c.fault, True, hosts, elements) for c in cells if c.fault in REDUCER_FAULTS]
    return cells


@dataclass
class Outcome:
    cell: Cell
    ok: bool
    expected: str
    happened: str
    seconds: float | None        # fault to the last survivor's error (or to the end of the job)
    problems: list[str] = field(default_factory=list)
    left_behind: list[str] = field(default_factory=list)  # processes, /dev/shm entries after the cell


class _Rank:
    """One rank's process and the JSON events it printed (read on a thread: never blocks us)."""

    def __init__(self, slot: RankSlot, proc: subprocess.Popen[str], log: Path):
        self.slot, self.proc, self.log = slot, proc, log
        self.events: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        with self.log.open("w") as copy:
            for line in stream:
                copy.write(line)
                copy.flush()
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass  # a warning from the library: kept in the log only

    def last(self, ev: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e.get("ev") == ev), None)

    @property
    def end(self) -> dict[str, Any] | None:
        """The job's final event (done, failure or wrong)."""
        return next((e for e in reversed(self.events) if e.get("ev") in ("done", "failure", "wrong")), None)


def _shm_entries(pids: set[int]) -> list[str]:
    """The shared-memory arenas in /dev/shm that processes ``pids`` created (an arena is named
    ``redsock-<creator pid>-<random>``: /dev/shm is the whole machine's, other jobs' come and go)."""
    try:
        names = os.listdir(ARENA_DIR)
    except OSError:
        return []
    creator = [n[len(ARENA_PREFIX):].split("-")[0] for n in names]
    return sorted(n for n, c in zip(names, creator) if n.startswith(ARENA_PREFIX) and c.isdigit() and int(c) in pids)


def _set_link(tb: Testbed, host: str, up: bool) -> None:
    """The host's cable: its port on the bridge (the host keeps its own interface and address)."""
    h = tb.host(host)
    nx.run(["ip", "-n", h.peer_ns, "link", "set", h.peer_dev, "up" if up else "down"])


def _wait_exit(procs: Sequence[subprocess.Popen[Any]], deadline: float) -> None:
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def run_cell(tb: Testbed, cell: Cell, timeout_s: float, logdir: Path, port: int,
             fault_after_s: float = 1.0, start_s: float = 60.0) -> Outcome:
    """Run one cell on ``tb`` (which has the cell's worker hosts w0.. and reducer host s0) and judge it."""
    algo = ALGOS[cell.algo][0]
    count = cell.shape[0]
    slots = cell.slots()
    world = len(slots)
    uses_reducer = cell.algo in USES_REDUCER
    victims = cell.victims()
    reducer_addr = f"{tb.host_addr(REDUCER_HOST)}:{SERVER_PORT}"  # the one the reducer faults hit
    every_reducer = [f"{tb.host_addr(name)}:{SERVER_PORT}" for name in tb.server_names]  # (s0 among them)
    servers: list[Proc] = []
    ranks: list[_Rank] = []
    problems: list[str] = []
    t_fault: float | None = None
    cut = False
    cell_dir = logdir / cell.name.replace(" / ", "_").replace(" ", "-").replace("+", "_")
    cell_dir.mkdir(parents=True, exist_ok=True)
    # Enough steps that the job outlasts the fault (and a flap by several seconds): the pause
    # alone makes 6 s, and a stalled step stops the clock.
    steps, pause = 120, 0.05
    try:
        if uses_reducer:
            servers = start_servers(tb, cell_dir, time.monotonic() + start_s)
        extra = {"REDSOCK_TIMEOUT_S": str(timeout_s), "REDSOCK_SERVER_FALLBACK": "ring" if cell.fallback else "none"}
        for slot in slots:
            env = rank_env(tb, slot, world, port)
            if not uses_reducer:
                env.pop("REDSOCK_SERVERS", None)
            argv = [sys.executable, "-m", "redsock.faults.job", "--steps", str(steps), "--count", str(count),
                    "--algo", algo, "--pause", str(pause)]
            err = (cell_dir / f"{slot.label}.err").open("w")
            proc = tb.popen(slot.host, argv, env=child_env({**env, **extra}), stdout=subprocess.PIPE, stderr=err,
                            text=True, start_new_session=True)
            err.close()
            ranks.append(_Rank(slot, proc, cell_dir / f"{slot.label}.log"))

        deadline = time.time() + start_s
        while not all(r.last("ready") for r in ranks):
            if time.time() > deadline or any(r.proc.poll() is not None for r in ranks):
                raise RedsockError("the job did not start: " + "; ".join(
                    f"rank {r.slot.rank} exit {r.proc.poll()} {r.end or ''}" for r in ranks))
            time.sleep(0.05)
        time.sleep(fault_after_s)

        # -- the fault
        victim_rank = next((r for r in ranks if r.slot.rank in victims), None)
        t_fault = time.time()
        if cell.fault in ("kill", "stop") and victim_rank is not None:  # (a rank fault always names one)
            victim_rank.proc.send_signal(signal.SIGKILL if cell.fault == "kill" else signal.SIGSTOP)
        elif cell.fault in ("link", "flap"):
            _set_link(tb, VICTIM_HOST, False)
            cut = True
        elif cell.fault == "srv-term":
            servers[0].proc.send_signal(signal.SIGTERM)
        elif cell.fault == "srv-kill":
            servers[0].proc.send_signal(signal.SIGKILL)
        elif cell.fault == "srv-link":
            _set_link(tb, REDUCER_HOST, False)
            cut = True
        if cell.fault == "flap":
            time.sleep(FLAP_S)
            _set_link(tb, VICTIM_HOST, True)
            cut = False
        if cell.fault == "srv-term":
            t_srv = time.time()
            _wait_exit([servers[0].proc], t_fault + REDUCER_EXIT_S)
            code = servers[0].proc.poll()
            if code != 0:
                problems.append(f"reducer after SIGTERM: exit {code} within {time.time() - t_srv:.1f} s (want 0 "
                                f"within {REDUCER_EXIT_S:.0f} s)")

        # -- the outcome: every rank still running ends by itself, in time
        alive = [r for r in ranks if r.slot.rank not in victims or cell.fault == "link"]
        limit = timeout_s + GRACE_S
        # A surviving job still has its steps to run: give it the time they take, more than enough.
        end_by = t_fault + (limit if not cell.survives else FLAP_S + limit + 60.0)
        _wait_exit([r.proc for r in alive], end_by + 10.0)  # past the bound too, to tell late from hung
        times = []
        for r in alive:
            who = f"rank {r.slot.rank}"
            end = r.end
            if r.proc.poll() is None:
                problems.append(f"{who} hung (no result {end_by + 10.0 - t_fault:.0f} s after the fault)")
                continue
            if end is None:
                problems.append(f"{who} exited {r.proc.returncode} with no result (see {r.log})")
                continue
            dt = end["t"] - t_fault
            times.append(dt)
            if cell.survives:
                if end["ev"] != "done":
                    problems.append(f"{who}: {end['ev']} {end.get('message', end.get('wrong', ''))}")
                continue
            if end["ev"] != "failure" or end.get("kind") != "PeerFailure":
                problems.append(f"{who}: {end['ev']} {end.get('kind', '')} (want PeerFailure)")
                continue
            if dt > limit:
                problems.append(f"{who}: PeerFailure after {dt:.1f} s (> {limit:.0f} s)")
            problems += _blame_problems(cell, r.slot, slots, end, reducer_addr, every_reducer)
        happened = _summary(cell, alive, victims, every_reducer)
        seconds = max(times) if times else None
    except RedsockError as e:
        problems.append(str(e))
        happened, seconds = f"error: {e}", None
    finally:
        if cut:
            _set_link(tb, VICTIM_HOST if cell.fault in ("link", "flap") else REDUCER_HOST, True)
        for r in ranks:  # the victim (SIGCONT first, so a stopped process can take its SIGKILL at once)
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGCONT)
        _wait_exit([r.proc for r in ranks if r.slot.rank in victims and cell.fault == "link"],
                   time.time() + 1.0)
        for r in ranks:
            if r.proc.poll() is None:
                if r.slot.rank not in victims or cell.fault == "link":
                    problems.append(f"rank {r.slot.rank} still running at the end of the cell")
                r.proc.kill()
            r.proc.wait(timeout=10)
        stop(servers)
    left_behind = []
    pids = {h: p for h, p in ((h, nx.netns_pids(tb.ns(h))) for h in tb.hosts) if p}
    if pids:
        left_behind.append(f"processes {pids}")
        for h in pids:
            nx.kill_netns_procs(tb.ns(h))
    arenas = _shm_entries({r.proc.pid for r in ranks})
    if arenas:
        left_behind.append(f"/dev/shm {arenas}")
    problems += [f"left behind: {x}" for x in left_behind]
    return Outcome(cell, not problems, _expected(cell, timeout_s, reducer_addr), happened, seconds, problems,
                   left_behind)


def _blame_problems(cell: Cell, slot: RankSlot, slots: list[RankSlot], end: dict[str, Any],
                    reducer_addr: str, every_reducer: Sequence[str]) -> list[str]:
    """Whom a survivor's PeerFailure names must be right: the victims, or the reducer (the one
    the fault hit, ``reducer_addr``); from a cut-off host, someone on the far side of the cut,
    which is every reducer (``every_reducer``: with several, the one it waited on)."""
    who, named, msg = f"rank {slot.rank}", set(end.get("ranks", [])), end.get("message", "")
    if cell.fault in REDUCER_FAULTS:
        if reducer_addr not in msg or named:
            return [f"{who} named ranks {sorted(named)} / not the reducer {reducer_addr}: {msg}"]
        return []
    if cell.fault == "link" and slot.host == VICTIM_HOST:
        far = {s.rank for s in slots if s.host != VICTIM_HOST}
        if named and named <= far or (not named and any(a in msg for a in every_reducer)):
            return []
        return [f"{who} (cut off) named {sorted(named)}, want ranks of {sorted(far)} or a reducer: {msg}"]
    victims = set(cell.victims())
    if not named or not named <= victims:
        return [f"{who} named {sorted(named)}, want {sorted(victims)}: {msg}"]
    return []


def _expected(cell: Cell, timeout_s: float, reducer_addr: str) -> str:
    if cell.fault == "flap":
        return "right results to the end"
    if cell.survives:
        return "ring fallback, right results"
    who = reducer_addr if cell.fault in REDUCER_FAULTS else "rank " + ",".join(map(str, cell.victims()))
    return f"PeerFailure naming {who} <= {timeout_s + GRACE_S:.0f} s"


def _summary(cell: Cell, alive: list[_Rank], victims: list[int], reducers: Sequence[str]) -> str:
    """What the ranks still alive reported, grouped: ``0,2: PeerFailure [1]``."""
    groups: dict[str, list[int]] = {}
    for r in alive:
        end = r.end
        if r.proc.poll() is None:
            what = "hung"
        elif end is None:
            what = f"exit {r.proc.returncode}"
        elif end["ev"] == "done":
            what = f"done {end['steps']} steps"
        elif end["ev"] == "wrong":
            what = f"WRONG at step {end['i']}"
        else:
            named = end.get("ranks") or []
            addr = next((a for a in reducers if a in end.get("message", "")), "")  # (the reducer it names)
            what = end.get("kind", "?") + (f" {named}" if named else f" {addr}" if addr else "")
        groups.setdefault(what, []).append(r.slot.rank)
    return "; ".join(f"{','.join(map(str, rs))}: {w}" for w, rs in groups.items())


def table(outcomes: Sequence[Outcome]) -> str:
    rows = [("cell", "expected", "what happened", "s", "result")]
    for o in outcomes:
        rows.append((o.cell.name, o.expected, o.happened, "-" if o.seconds is None else f"{o.seconds:.1f}",
                     "ok" if o.ok else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for o in outcomes:
        for p in o.problems:
            lines.append(f"  {o.cell.name}: {p}")
    return "\n".join(lines)


def run_matrix(cells: Sequence[Cell], timeout_s: float, prefix: str, rate: str = "1gbit",
               logdir: Path | None = None, out: IO[str] = sys.stdout,
               servers: int = 1) -> tuple[list[Outcome], list[str]]:
    """Build the cluster, run ``cells`` one after another, tear it down.  Returns the outcomes
    and what was left behind at the end (namespaces of the prefix)."""
    nx.require_root("redsock testbed faults")
    logdir = Path(logdir or tempfile.mkdtemp(prefix="redsock-faults-"))
    outcomes: list[Outcome] = []
    tb = Testbed(workers=max(c.shape[1] for c in cells), servers=servers, rate=rate, prefix=prefix)
    try:
        tb.up()
        for hostname in tb.hosts:  # bbr collapses through tbf with no delay (DESIGN.md section 6)
            nx.run(["ip", "netns", "exec", tb.ns(hostname), "sysctl", "-q", "-w",
                    "net.ipv4.tcp_congestion_control=reno"])
        for i, cell in enumerate(cells):
            t0 = time.monotonic()
            o = run_cell(tb, cell, timeout_s, logdir, port=29600 + i)
            outcomes.append(o)
            secs = "-" if o.seconds is None else f"{o.seconds:.1f} s"
            print(f"[{i + 1}/{len(cells)}] {cell.name}: {'ok' if o.ok else 'FAIL'} ({o.happened}; {secs}; "
                  f"cell {time.monotonic() - t0:.0f} s)", file=out, flush=True)
            for p in o.problems:
                print(f"    {p}", file=out, flush=True)
    finally:
        tb.down()
    return outcomes, list_prefix_netns(prefix)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algos", default=",".join(DEFAULT_ALGOS), help=f"comma-separated, of {','.join(ALGOS)} "
                   f"(default {','.join(DEFAULT_ALGOS)})")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--no-fallback", action="store_true", help="skip the REDSOCK_SERVER_FALLBACK=ring cells")
    p.add_argument("--timeout", type=float, default=6.0, help="REDSOCK_TIMEOUT_S of the jobs (default 6)")
    p.add_argument("--rate", default="1gbit", help="link rate (default 1gbit)")
    p.add_argument("--hosts", type=int, default=0,
                   help="worker hosts (default: each algorithm's own, 3 flat, 2 hierarchical)")
    p.add_argument("--servers", type=int, default=1,
                   help="reducer hosts s0.. (default 1; reducer faults hit s0)")
    p.add_argument("--size", default=None,
                   help="bytes per all-reduce, e.g. 8M (default: each algorithm's own, 1M, small 1K)")
    p.add_argument("--prefix", default="rsflt", help="namespace prefix (default rsflt)")
    p.add_argument("--logdir", type=Path, help="where the ranks' and reducers' logs go (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    elements = parse_size(args.size) // 4 if args.size else 0
    if args.size and elements < 1:
        raise ConfigError(f"--size must be at least 4 bytes (one float32), got {args.size!r}")
    if args.servers < 1:
        raise ConfigError(f"--servers must be at least 1, got {args.servers}")
    cells = matrix([a for a in args.algos.split(",") if a], [f for f in args.faults.split(",") if f],
                   args.hosts, elements)
    if args.no_fallback:
        cells = [c for c in cells if not c.fallback]
    t0, cpu0 = time.monotonic(), box_cpu()
    outcomes, left = run_matrix(cells, args.timeout, args.prefix, args.rate, args.logdir, servers=args.servers)
    busy, steal = cpu_shares(cpu0, box_cpu())
    print()
    print(table(outcomes))
    bad = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(bad)} of {len(outcomes)} cells as expected in {time.monotonic() - t0:.0f} s "
          f"(REDSOCK_TIMEOUT_S={args.timeout:g}; machine busy {100 * busy:.0f}%, steal {100 * steal:.0f}%); "
          f"namespaces left: {' '.join(left) if left else 'none'}; processes or /dev/shm entries left after a "
          f"cell: {sum(bool(o.left_behind) for o in outcomes) or 'none'}")
    if left:
        cleanup_prefix(args.prefix)
    return 1 if bad or left else 0
