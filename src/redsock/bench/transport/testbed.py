"""``redsock bench transport --testbed perflow``: the transport under per-flow path imbalance.

The acceptance benchmark of the Fast Socket transport.  It builds a
:class:`~redsock.testbed.PairTestbed`: namespaces ``a`` (198.18.1.1) and ``b``
(198.18.1.2) joined by one veth whose ``a``-side egress has one htb class per
rate in ``--rates`` (default 800/600/400/200 Mbit/s), picked by u32 on
source-port bits (:func:`~redsock.testbed.path_class`) — like ECMP paths of
unequal speed.  The ``--listen`` side of ``redsock bench transport`` runs in
``b``; the driver (the *sender* of the one-way throughput test, so its data
streams' source ports pick the path classes) runs in ``a``, once per
configuration:

* redsock, ``balance=dynamic``, ``--nsocks`` streams;
* redsock, ``balance=static`` (NCCL-socket-style even split), the same streams;
* ``plain``: one blocking TCP socket (if ``--impl`` includes it);
* redsock dynamic with each of ``--extra-nsocks`` streams (e.g. 8).

Fair comparison.  Ephemeral source ports are random, so two connections
usually land in different classes.  The transport's ``connect`` cannot bind
source ports, so the driver *reconnects* until the data streams land on the
wanted multiset of classes (``--land spread``, the default: stream *i* on
class ``i mod nclasses`` up to a permutation — with 4 streams one stream per
class, with 8 two per class).  ``--land random`` takes the dynamic run's
first connection as it comes and makes the static run match its classes.
A rejected connection runs an empty session (a plan with no cases) and waits
for the listener to close it, so the listener never sees a half session.
The plain baseline is put on the fastest class, its best case.

Capacity.  The capacity of a run is the sum of the *distinct* classes its
streams hit (streams in the same class share it).  tc counts frame headers,
so the payload goodput a class can carry is about ``GOODPUT_FACTOR`` (0.956)
of its configured rate (measured on this testbed); the table shows the
throughput against both.  The acceptance verdict uses the *configured*
capacity (the stricter of the two).

Diagnostics per stream (``extra.streams`` in ``--json``): source port,
class, bytes and slices sent, achieved Mbit/s, the share of bytes against
the share its class would give it, and the *tail*: how long before the end
of a repetition the stream handed its last slice to the kernel (a stream that
runs dry early idles while slower ones finish).  Per class, the bytes tc
really sent (from ``tc -s class show``).

The driver is also a command of its own (``python -m
redsock.bench.transport.driver drive --connect HOST:PORT ...``, :mod:`.driver`), which is
what runs inside namespace ``a``.

Notes on the transport found while building this (see the issue's report):

* A message sent inline just before ``close()`` can be lost by the peer: its
  data-stream receiver threads see the close, fail to take the control
  stream's receive lock (the waiter for that very message holds it), and
  abort the connection, failing the receive although its bytes are already
  in the control socket.  The listener ends every session with such an ack,
  so the driver appends :data:`SENTINEL`, a last case whose ack may be lost.
* The listener's serve loop has no per-session error handling: a session
  that fails (e.g. a client closing before its plan is read) ends the
  listener.  Rejected connections therefore run an empty session.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ...config import Config, parse_size
from ...errors import ConfigError, RedsockError
from ...testbed import netns as nx
from ...testbed.cluster import PairTestbed
from ...testbed.launch import no_interrupts, terminate_as_interrupt
from ...testbed.netns import parse_rate, path_class
from ..bounds import GOODPUT_FACTOR
from .driver import want_spread
from .session import (
    TransportRow,
    _human,
)

PROFILES = ("perflow",)
DEFAULT_RATES = "800mbit,600mbit,400mbit,200mbit"
#: Acceptance bounds of the issue (full size): dynamic >= 85% of capacity, >= 1.6x static.
ACCEPT_PCT = 0.85
ACCEPT_RATIO = 1.6
LISTEN_PORT = 7000
#: ``--sizes`` of plain ``bench transport``; under ``--testbed`` it means the acceptance size.
_TRANSPORT_DEFAULT_SIZES = "8,64K,1M,16M,256M"
TESTBED_DEFAULT_SIZES = "256M"


# ------------------------------------------------------------------------ the orchestrator

@dataclass
class RunSpec:
    impl: str
    balance: str
    nsocks: int
    want: list[int] | None  # class multiset to land on; None = as it comes
    match: str = ""         # label of an earlier run to land where it landed (--land random)

    @property
    def label(self) -> str:
        return "plain" if self.impl == "plain" else f"{self.balance}x{self.nsocks}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``--testbed`` (the option itself is in the side group of the package's parser)."""
    g = p.add_argument_group(
        "--testbed (emulated per-flow path imbalance; needs root)",
        "With --testbed PROFILE (perflow), --sizes defaults to 256M and both balances run "
        "(dynamic and static over the same path classes) unless --balance picks one; "
        "--impl plain adds the one-socket baseline on the fastest class.")
    g.add_argument("--rates", default=DEFAULT_RATES,
                   help="path class rates, a power-of-two count (default %(default)s)")
    g.add_argument("--extra-nsocks", default="",
                   help="also run balance=dynamic with these stream counts (e.g. 8)")
    g.add_argument("--lowat", help="TCP_NOTSENT_LOWAT of the data streams (REDSOCK_NOTSENT_LOWAT; 0 = off)")
    g.add_argument("--land", choices=["spread", "random"], default="spread",
                   help="spread: reconnect until stream i lands on class i mod nclasses (default); "
                        "random: first connection for dynamic, static reconnects to match it")
    g.add_argument("--max-attempts", type=int, default=400, help="reconnects allowed to land a run")
    g.add_argument("--prefix", help="testbed namespace prefix (default rsbt<pid>)")


def _rates(text: str) -> list[int]:
    rates = [parse_rate(r) for r in text.split(",") if r.strip()]
    if not rates:
        raise ConfigError("--rates needs at least one rate")
    return rates


def plan_runs(args: argparse.Namespace, config: Config, nclasses: int,
              rates: Sequence[int]) -> list[RunSpec]:
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    for impl in impls:
        if impl not in ("redsock", "plain"):
            raise ConfigError(f"unknown impl {impl!r} (redsock, plain)")
    balances = [args.balance] if args.balance else ["dynamic", "static"]
    n = config.nsocks
    spread = args.land == "spread"
    runs: list[RunSpec] = []
    if "redsock" in impls:
        for bal in balances:
            if spread:
                runs.append(RunSpec("redsock", bal, n, want_spread(n, nclasses)))
            elif runs:
                runs.append(RunSpec("redsock", bal, n, None, match=runs[0].label))
            else:
                runs.append(RunSpec("redsock", bal, n, None))
        try:
            extra = [int(x) for x in args.extra_nsocks.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--extra-nsocks wants stream counts like 8 or 8,16, "
                              f"not {args.extra_nsocks!r}") from None
        for k in extra:
            if k != n:
                runs.append(RunSpec("redsock", "dynamic", k, want_spread(k, nclasses) if spread else None))
    if "plain" in impls:
        fastest = max(range(nclasses), key=lambda c: rates[c])
        runs.append(RunSpec("plain", "-", 1, [fastest]))
    return runs


_CLASS_RE = re.compile(r"^class htb 1:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes (\d+) pkt \(dropped (\d+)",
                       re.M | re.S)


def class_counters(tb: PairTestbed) -> dict[int, dict[str, int]]:
    """Bytes/packets/drops sent so far by each path class of a's egress (``tc -s class show``)."""
    h = tb.host("a")
    out = nx.run(["tc", "-n", h.ns, "-s", "class", "show", "dev", h.dev]).stdout
    counters = {}
    for block in out.split("\n\n"):
        m = _CLASS_RE.search(block.strip())
        if m and int(m.group(1), 16) >= 0x10:
            counters[int(m.group(1), 16) - 0x10] = {"bytes": int(m.group(2)), "pkts": int(m.group(3)),
                                                    "drops": int(m.group(4))}
    return counters


def _start_listener(tb: PairTestbed, log: Any) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "redsock", "bench", "transport",
            "--listen", f"{tb.host_addr('b')}:{LISTEN_PORT}"]
    proc = tb.popen("b", argv, stdout=subprocess.PIPE, stderr=log, text=True)
    got: dict[str, str] = {}

    def read() -> None:
        got["line"] = proc.stdout.readline() if proc.stdout else ""

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    if not got.get("line", "").startswith("listening"):
        raise RedsockError(f"the listener in {tb.ns('b')} did not start: {got.get('line', '')!r}; "
                           f"stderr: {_tail(log)}")
    return proc


def _tail(log: Any, n: int = 2000) -> str:
    try:
        log.flush()
        with open(log.name) as f:
            return f.read()[-n:].strip()
    except OSError:
        return ""


def _drive_in_a(tb: PairTestbed, spec: RunSpec, want: list[int] | None, config: Config,
                args: argparse.Namespace, nclasses: int, listener: subprocess.Popen[str],
                log: Any) -> list[TransportRow]:
    env = {**os.environ,
           "REDSOCK_NSOCKS": str(spec.nsocks), "REDSOCK_BALANCE": spec.balance if spec.impl == "redsock"
           else config.balance, "REDSOCK_CHUNK_BYTES": str(config.chunk_bytes),
           "REDSOCK_NOTSENT_LOWAT": str(config.notsent_lowat)}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [sys.executable, "-m", "redsock.bench.transport.driver", "drive",
            "--connect", f"{tb.host_addr('b')}:{LISTEN_PORT}", "--impl", spec.impl,
            "--sizes", args.sizes, "--iters", str(args.iters), "--reps", str(args.reps),
            "--nclasses", str(nclasses), "--shift", str(tb.shift),
            "--want", ",".join(map(str, want or [])), "--max-attempts", str(args.max_attempts)]
    before = class_counters(tb)
    proc = tb.popen("a", argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    after = class_counters(tb)
    if proc.returncode != 0:
        time.sleep(0.5)  # let a failing listener finish exiting, so its state and log are known
        state = f"exited with {listener.returncode}" if listener.poll() is not None else "still running"
        why = f"[listener {state}; its log: {_tail(log) or '(empty)'}]"
        raise RedsockError(f"driver run {spec.label} failed (exit {proc.returncode}): "
                           f"{err.strip()[-2000:]} {why}".strip())
    if err.strip():
        sys.stderr.write(err)
    rows = []
    for line in out.splitlines():
        if line.strip().startswith("{"):
            d = json.loads(line)
            rows.append(TransportRow(**d))
    sent = {c: after[c]["bytes"] - before.get(c, {"bytes": 0})["bytes"] for c in after}
    drops = {c: after[c]["drops"] - before.get(c, {"drops": 0})["drops"] for c in after}
    for r in rows:  # per-class counters cover the whole run (warm-up and every size)
        r.extra["class_sent_bytes"] = [sent.get(c, 0) for c in range(nclasses)]
        r.extra["class_drops"] = [drops.get(c, 0) for c in range(nclasses)]
    return rows


def annotate(row: TransportRow, rates: Sequence[int], shift: int) -> None:
    """Classes hit, capacity and the share of each stream, into ``row.extra``."""
    n = len(rates)
    ports = row.extra["src_ports"]
    classes = [path_class(p, n, shift) for p in ports]
    hit = sorted(set(classes))
    cap = sum(rates[c] for c in hit)
    per_class = {c: classes.count(c) for c in hit}
    total = sum(row.extra.get("bytes_per_stream", [])) or 1
    streams = []
    for i, (p, c) in enumerate(zip(ports, classes)):
        fair = rates[c] / per_class[c]  # the class shared evenly by its streams
        streams.append({
            "port": p, "class": c, "class_rate": rates[c], "fair_bps": fair,
            "bytes": row.extra["bytes_per_stream"][i], "slices": row.extra["slices_per_stream"][i],
            "mbps": row.extra["stream_mbps"][i], "tail_ms": row.extra["tail_ms"][i],
            "share": row.extra["bytes_per_stream"][i] / total, "ideal_share": fair / cap,
        })
    row.extra.update({
        "classes": classes, "classes_hit": hit, "capacity_bps": cap,
        "goodput_capacity_bps": cap * GOODPUT_FACTOR, "goodput_factor": GOODPUT_FACTOR,
        "pct_capacity": row.gbps * 1e9 / cap, "pct_goodput": row.gbps * 1e9 / (cap * GOODPUT_FACTOR),
        "streams": streams, "rates": list(rates),
    })


def ratios(rows: list[TransportRow]) -> list[dict[str, Any]]:
    """dynamic/static for each (size, nsocks) present in both, on the same classes."""
    out = []
    for d in rows:
        if d.impl != "redsock" or d.balance != "dynamic":
            continue
        for s in rows:
            if (s.impl == "redsock" and s.balance == "static" and s.bytes == d.bytes
                    and s.nsocks == d.nsocks and s.gbps > 0):
                same = sorted(d.extra["classes"]) == sorted(s.extra["classes"])
                out.append({"bytes": d.bytes, "nsocks": d.nsocks, "dynamic_gbps": d.gbps,
                            "static_gbps": s.gbps, "ratio": d.gbps / s.gbps, "same_classes": same})
                d.extra["dynamic_over_static"] = d.gbps / s.gbps
    return out


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:.0f}"


def format_table(rows: list[TransportRow], rates: Sequence[int]) -> str:
    head = (f"{'size':>8} {'impl':>7} {'balance':>7} {'streams':>7} {'stream classes':>15} "
            f"{'hit':>8} {'cap Mbit':>8} {'good Mbit':>9} {'Gbit/s':>7} {'% cap':>6} {'% good':>6} "
            f"{'reps Gbit/s':>18}")
    lines = ["path classes (Mbit/s): " + ", ".join(f"{i}={_mbit(r)}" for i, r in enumerate(rates))
             + f"; goodput capacity = {GOODPUT_FACTOR} x configured", head, "-" * len(head)]
    for r in rows:
        e = r.extra
        reps = ",".join(f"{g:.2f}" for g in e.get("rep_gbps", []))
        lines.append(
            f"{_human(r.bytes):>8} {r.impl:>7} {r.balance:>7} {r.nsocks:>7} "
            f"{''.join(map(str, e['classes'])):>15} {','.join(map(str, e['classes_hit'])):>8} "
            f"{_mbit(e['capacity_bps']):>8} {_mbit(e['goodput_capacity_bps']):>9} {r.gbps:7.3f} "
            f"{100 * e['pct_capacity']:6.1f} {100 * e['pct_goodput']:6.1f} {reps:>18}")
    return "\n".join(lines)


def format_streams(rows: list[TransportRow]) -> str:
    head = (f"{'run':>16} {'#':>2} {'port':>5} {'cls':>3} {'cls Mbit':>8} {'fair Mbit':>9} "
            f"{'got Mbit':>8} {'share%':>6} {'ideal%':>6} {'slices':>7} {'tail ms':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.impl != "redsock":
            continue
        label = f"{_human(r.bytes)} {r.balance}x{r.nsocks}"
        for i, s in enumerate(r.extra["streams"]):
            lines.append(f"{label if i == 0 else '':>16} {i:>2} {s['port']:>5} {s['class']:>3} "
                         f"{_mbit(s['class_rate']):>8} {_mbit(s['fair_bps']):>9} {s['mbps']:8.1f} "
                         f"{100 * s['share']:6.1f} {100 * s['ideal_share']:6.1f} {s['slices']:>7} "
                         f"{s['tail_ms']:7.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``redsock bench transport --testbed PROFILE``: build, measure every configuration, tear down."""
    if args.testbed not in PROFILES:
        raise ConfigError(f"unknown testbed profile {args.testbed!r}; choose one of {', '.join(PROFILES)}")
    nx.require_root("redsock bench transport --testbed")
    if args.sizes == _TRANSPORT_DEFAULT_SIZES:  # not given: the acceptance size, not the latency sweep
        args.sizes = TESTBED_DEFAULT_SIZES
    rates = _rates(args.rates)
    config = Config.from_env(nsocks=args.nsocks, chunk_bytes=parse_size(args.chunk) if args.chunk else None,
                             notsent_lowat=parse_size(args.lowat) if args.lowat is not None else None)
    tb = PairTestbed(rates, args.prefix or f"rsbt{os.getpid()}")  # validates rates and prefix
    nclasses = len(rates)
    runs = plan_runs(args, config, nclasses, rates)
    rows = run_testbed(tb, runs, config, args, nclasses)
    for r in rows:
        annotate(r, rates, tb.shift)
    rat = ratios(rows)
    print(format_table(rows, rates))
    print()
    print(format_streams(rows))
    print()
    print(f"chunk {_human(config.chunk_bytes)}, TCP_NOTSENT_LOWAT "
          f"{_human(config.notsent_lowat) if config.notsent_lowat else 'off'}, "
          f"{args.iters} messages per rep (up to 8 in flight), {args.reps} reps, median reported")
    for x in rat:
        print(f"{_human(x['bytes']):>8} dynamic/static over {x['nsocks']} streams = {x['ratio']:.2f}x "
              f"({x['dynamic_gbps']:.3f} / {x['static_gbps']:.3f} Gbit/s; "
              f"{'same classes' if x['same_classes'] else 'DIFFERENT classes'})")
    for d in rows:
        if d.impl == "redsock" and d.balance == "dynamic" and d.nsocks >= nclasses:
            vs = next((x for x in rat if x["bytes"] == d.bytes and x["nsocks"] == d.nsocks), None)
            ok_cap = d.extra["pct_capacity"] >= ACCEPT_PCT
            line = (f"{_human(d.bytes):>8} acceptance ({d.nsocks} streams): dynamic at "
                    f"{100 * d.extra['pct_capacity']:.1f}% of configured capacity "
                    f"({100 * d.extra['pct_goodput']:.1f}% of goodput capacity) "
                    f"{'>=' if ok_cap else '<'} {100 * ACCEPT_PCT:.0f}% [verdict on configured]")
            if vs is not None:
                line += (f"; {vs['ratio']:.2f}x static {'>=' if vs['ratio'] >= ACCEPT_RATIO else '<'} "
                         f"{ACCEPT_RATIO}x")
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(asdict(r)) + "\n")
    return 0


def run_testbed(tb: PairTestbed, runs: list[RunSpec], config: Config, args: argparse.Namespace,
                nclasses: int) -> list[TransportRow]:
    """Bring ``tb`` up, serve in b, drive each run from a; always tear down (also on signals)."""
    rows: list[TransportRow] = []
    landed: dict[str, list[int]] = {}
    with terminate_as_interrupt(), tempfile.NamedTemporaryFile("w+", prefix="redsock-listener-",
                                                                suffix=".log") as log:
        try:
            tb.up()
            listener = _start_listener(tb, log)
            for spec in runs:
                want = landed.get(spec.match) if spec.match else spec.want
                got = _drive_in_a(tb, spec, want, config, args, nclasses, listener, log)
                if got:
                    landed[spec.label] = sorted(path_class(p, nclasses, tb.shift)
                                                for p in got[0].extra["src_ports"])
                rows.extend(got)
        finally:
            with no_interrupts():
                tb.down()
    return rows
