"""``redsock bench ddp --testbed``: DDP training steps/s on an emulated cluster, per backend.

Builds one :class:`~redsock.testbed.Testbed` (workers ``w0..`` and reducers ``s0..``,
every link shaped to ``--rate`` both ways), starts a ``redsock serve`` per reducer
host, then trains ``examples/train_lm.py`` with ``--ranks-per-host`` L ranks on every
one of the ``--workers`` H worker hosts (N = H x L ranks, consecutive on a host as
torchrun numbers them; ``--workers`` counts hosts, so with the default L = 1 it is
also the number of ranks) once per algorithm of ``--algos``:

* ``gloo``   — ``--backend gloo`` (torch's own, the baseline);
* ``ring``   — ``--backend redsock`` with ``REDSOCK_ALGO=ring`` (Fast Socket ring);
* ``server`` — ``--backend redsock`` with ``REDSOCK_ALGO=server`` (the reducers, every
  rank on its own);
* ``auto``   — ``--backend redsock`` with ``REDSOCK_ALGO=auto``, the reducers set: what a
  user gets by default (with several ranks per host, a hierarchical all-reduce where
  redsock chooses one).

The training script is unchanged between them: only the backend name and the
environment differ, as for a user.  ``--repeats`` rounds run the algorithms in
turn (gloo, ring, server, gloo, ...) so a noisy machine spreads over all of them;
the median steps/s per algorithm is reported, with its ratio to gloo and the cost
per step in host-seconds (reducer hosts count: 4 workers + 4 reducers is 8 hosts).

The model is sized so that gradient exchange matters on this CPU-only machine:
the default is the example's 7.4 M-parameter model (30 MB of float32 gradients)
with one short sequence per rank, standing in for the fast accelerators of a
real cluster, whose compute per step is small next to a 1 Gbit/s link.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from .. import results as report
from ..errors import ConfigError, RedsockError
from ..testbed import launch
from ..testbed import netns as nx
from ..testbed.cluster import PROFILES, Testbed
from ..testbed.netns import format_rate, parse_rate
from .procs import box_cpu, cpu_shares

__all__ = ["ALGOS", "add_arguments", "parse_result", "run", "summarize", "train_script"]

#: algo -> (torch backend, extra environment of every rank)
ALGOS: dict[str, tuple[str, dict[str, str]]] = {
    "gloo": ("gloo", {}),
    "ring": ("redsock", {"REDSOCK_ALGO": "ring"}),
    "server": ("redsock", {"REDSOCK_ALGO": "server"}),
    "auto": ("redsock", {"REDSOCK_ALGO": "auto"}),
}
#: Algorithms that use the reducers (their hosts count in the cost per step).
USES_SERVERS = ("server", "auto")
_RESULT = re.compile(r"^RESULT (.*)$", re.M)


def train_script() -> Path:
    """``examples/train_lm.py`` of this source tree (the benchmark trains the shipped example)."""
    path = Path(__file__).resolve().parents[3] / "examples" / "train_lm.py"
    if not path.is_file():
        raise ConfigError(f"the example training script is not at {path}: "
                          "run from a source checkout (pip install -e .)")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--testbed", action="store_true", required=True,
                   help="run every rank in its own network namespace with shaped links (needs root)")
    p.add_argument("--workers", type=int, default=4,
                   help="worker hosts (default 4); ranks = workers x --ranks-per-host")
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="L",
                   help="ranks on every worker host, consecutive as torchrun numbers them (default 1)")
    p.add_argument("--servers", type=int, help="reducer hosts (default: as many as workers)")
    p.add_argument("--rate", default="1gbit", help="link rate each way (default 1gbit)")
    p.add_argument("--profile", default="uniform", choices=PROFILES, help="link profile (default uniform)")
    p.add_argument("--algos", default=None,
                   help="comma-separated: gloo, ring, server, auto (default gloo,ring,server; with several "
                        "ranks per host gloo,auto,server: auto is then the hierarchy a user gets)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of steps/s (default 5)")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the algorithms; median reported")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="DDP bucket size (default 25; 0: DDP's own default, a 1 MB first bucket then 25 MB)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="sgd (default: cheap, so the step is mostly gradient exchange) or adamw")
    p.add_argument("--tcp-cc", metavar="NAME", default="reno", help="TCP congestion control in the hosts")
    p.add_argument("--prefix", help="namespace prefix (default rsdp<pid>)")
    p.add_argument("--timeout", type=float, default=600.0, help="stop everything after this many seconds")
    p.add_argument("--json", metavar="FILE", help="write one JSON object per algorithm")
    p.add_argument("--wire-dtype", choices=["off", "bf16", "fp16"], default="off",
                   help="redsock's runs all-reduce gradient buckets with redsock.torch.compress_hook on this "
                        "16-bit wire (float32 sums, error feedback); gloo's runs are unchanged (default off)")


def parse_result(text: str) -> dict[str, Any]:
    """The ``RESULT key=value ...`` line the training script prints on rank 0."""
    m = _RESULT.findall(text)
    if not m:
        raise RedsockError("rank 0 printed no RESULT line")
    out: dict[str, Any] = {}
    for kv in m[-1].split():
        k, _, v = kv.partition("=")
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def summarize(results: dict[str, list[dict[str, Any]]], workers: int, servers: int, rate: int,
              ranks_per_host: int = 1) -> list[dict[str, Any]]:
    """One object per algorithm: median steps/s over its runs, ratio to gloo, host-seconds per step
    (``workers`` counts worker hosts, each running ``ranks_per_host`` ranks)."""
    out = []
    for algo, runs in results.items():
        sps = statistics.median(r["steps_per_s"] for r in runs)
        used_servers = servers if algo in USES_SERVERS else 0
        hosts = workers + used_servers
        last = runs[-1]
        out.append({"algo": algo, "backend": ALGOS[algo][0], "workers": workers, "servers": used_servers,
                    "ranks_per_host": ranks_per_host, "world": workers * ranks_per_host,
                    "rate_bps": rate, "steps": last["steps"], "runs": [r["steps_per_s"] for r in runs],
                    "time_s": statistics.median(r["time_s"] for r in runs), "steps_per_s": sps,
                    "final_loss": last["final_loss"], "grad_bytes": last.get("grad_bytes", 0),
                    "hosts": hosts, "host_s_per_step": hosts / sps,
                    # Retransmission timeouts over all runs: each stalls a flow >= 200 ms.
                    "tcp_timeouts": sum(r["tcp"]["TCPTimeouts"] for r in runs),
                    # How busy the whole machine was (a CPU-bound run does not measure the network).
                    "machine_busy": statistics.median(r["machine_busy"] for r in runs),
                    "machine_steal": statistics.median(r["machine_steal"] for r in runs)})
    gloo = next((o for o in out if o["algo"] == "gloo"), None)
    for o in out:
        o["vs_gloo"] = o["steps_per_s"] / gloo["steps_per_s"] if gloo else None
        o["cost_vs_gloo"] = o["host_s_per_step"] / gloo["host_s_per_step"] if gloo else None
    return out


def format_summary(rows: Sequence[dict[str, Any]], workers: int, rate: int, ranks_per_host: int = 1) -> str:
    ranks = f" x {ranks_per_host} ranks (N={workers * ranks_per_host})" if ranks_per_host > 1 else ""
    lines = [f"# DDP {workers} workers{ranks}, links at {format_rate(rate)}: median steps/s over the runs; "
             "x gloo = steps/s ratio; host-s/step counts reducer hosts; RTOs = TCP retransmission timeouts, all runs; "
             "busy = the whole machine's CPU use during a run (median); steal = of that, the share the hypervisor "
             "gave other guests (median)",
             f"#{'algo':>7} {'steps/s':>9} {'x gloo':>7} {'hosts':>6} {'host-s/step':>12} {'cost x gloo':>12}"
             f" {'loss':>8} {'RTOs':>5} {'busy':>5} {'steal':>5}  runs"]
    for o in rows:
        vs = f"{o['vs_gloo']:.2f}" if o["vs_gloo"] else "-"
        cost = f"{o['cost_vs_gloo']:.2f}" if o["cost_vs_gloo"] else "-"
        runs = " ".join(f"{x:.3f}" for x in o["runs"])
        lines.append(f"{o['algo']:>8} {o['steps_per_s']:9.3f} {vs:>7} {o['hosts']:>6} {o['host_s_per_step']:12.2f}"
                     f" {cost:>12} {o['final_loss']:8.4f} {o['tcp_timeouts']:5d} {report.percent(o['machine_busy']):>5}"
                     f" {report.percent(o['machine_steal']):>5}  {runs}")
    return "\n".join(lines)


def _train_argv(args: argparse.Namespace, backend: str) -> list[str]:
    wire = getattr(args, "wire_dtype", "off")
    hook = ["--hook", "compress", "--wire", wire] if backend == "redsock" and wire != "off" else []
    return [sys.executable, str(train_script()), "--backend", backend, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--bucket-cap-mb", str(args.bucket_cap_mb), "--optimizer", args.optimizer,
            "--log-every", str(max(1, args.steps)), *hook]


def run(args: argparse.Namespace) -> int:
    """Build the testbed, train once per algorithm and repeat, report; always tear down."""
    chosen = args.algos or ("gloo,ring,server" if args.ranks_per_host == 1 else "gloo,auto,server")
    algos = [a.strip() for a in chosen.split(",") if a.strip()]
    unknown = [a for a in algos if a not in ALGOS]
    if unknown or not algos:
        raise ConfigError(f"--algos: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(ALGOS)}")
    servers = args.workers if args.servers is None else args.servers
    if set(algos) & set(USES_SERVERS) and servers < 1:
        raise ConfigError("--algos server / auto need --servers >= 1")
    if args.workers < 2:
        raise ConfigError("--workers must be >= 2")
    if args.ranks_per_host < 1:
        raise ConfigError("--ranks-per-host must be >= 1")
    if args.steps <= args.warmup or args.warmup < 0:
        raise ConfigError("--steps must exceed --warmup (>= 0)")
    if args.repeats < 1 or args.timeout <= 0:
        raise ConfigError("--repeats must be >= 1 and --timeout > 0")
    if args.bucket_cap_mb < 0:
        raise ConfigError("--bucket-cap-mb must be >= 0 (0: DDP's own default)")
    rate = parse_rate(args.rate)
    train_script()
    nx.require_root("redsock bench ddp --testbed")
    if not set(algos) & set(USES_SERVERS):
        servers = 0
    prefix = args.prefix or f"rsdp{os.getpid()}"
    tb = Testbed(workers=args.workers, servers=servers, rate=rate, profile=args.profile, prefix=prefix)
    deadline = time.monotonic() + args.timeout
    results: dict[str, list[dict[str, Any]]] = {a: [] for a in algos}
    rc = 0
    with tempfile.TemporaryDirectory(prefix="redsock-ddp-tb-") as tmp, launch.terminate_as_interrupt():
        logdir = Path(tmp)
        server_procs: list[launch.Proc] = []
        ranks: list[launch.Proc] = []
        try:
            print(f"# testbed {prefix}: {args.workers} workers x {args.ranks_per_host} rank(s) + {servers} reducers, "
                  f"{args.profile} links at {format_rate(rate)}"
                  + (f"; redsock's buckets on the {args.wire_dtype} wire (compress_hook, error feedback)"
                     if args.wire_dtype != "off" else ""), flush=True)
            tb.up()
            print(f"# TCP congestion control in the hosts: {launch.set_congestion_control(tb, args.tcp_cc)}", flush=True)
            if servers:
                server_procs = launch.start_servers(tb, logdir, deadline)
            n = 0
            for rep in range(args.repeats):
                for algo in algos:
                    backend, env = ALGOS[algo]
                    tag = f".{algo}{rep}"
                    print(f"# run {rep + 1}/{args.repeats}: {algo} (--backend {backend})", flush=True)
                    tcp0, box0 = launch.tcp_counters(tb), box_cpu()
                    # A fresh store port per run: the last run's may linger in TIME_WAIT.
                    ranks, relays = launch.start_ranks(tb, _train_argv(args, backend), logdir, env,
                                                 master_port=launch.MASTER_PORT + 1 + n, tag=tag,
                                                 ranks_per_host=args.ranks_per_host)
                    n += 1
                    why = launch.wait_ranks(ranks, server_procs, deadline, args.timeout)
                    launch.stop(ranks)
                    for t in relays:
                        t.join(timeout=5)
                    if why is None and any(p.proc.returncode for p in ranks):
                        why = "a rank exited with an error"
                    if why is not None:
                        for p in ranks:
                            if p.proc.returncode:
                                print(f"--- {p.name} (exit {p.proc.returncode}) ---\n{launch.tail(p.log) or '(no output)'}",
                                      file=sys.stderr)
                        raise RedsockError(f"{algo} run {rep + 1} failed: {why}")
                    result = parse_result(launch.rank0_output(tb, logdir, args.ranks_per_host, tag).read_text())
                    result["tcp"] = launch.tcp_delta(tcp0, launch.tcp_counters(tb))
                    result["machine_busy"], result["machine_steal"] = cpu_shares(box0, box_cpu())
                    print(f"# TCP during the run, all hosts: {launch.tcp_line(result['tcp'])}", flush=True)
                    print(f"# CPU during the run: the whole machine {result['machine_busy']:.0%} busy "
                          f"({os.cpu_count()} cores, start-up included; {result['machine_steal']:.0%} stolen by the "
                          "hypervisor)", flush=True)
                    results[algo].append(result)
            for s in server_procs:
                if s.proc.poll() is not None:
                    raise RedsockError(f"reduction server on {s.name} exited with {s.proc.returncode}: {launch.tail(s.log)}")
        except RedsockError as e:
            print(f"redsock: ddp testbed run failed: {e}", file=sys.stderr)
            rc = 1
        finally:
            with launch.no_interrupts():
                launch.stop(ranks + server_procs)
                tb.down()
    done = {a: r for a, r in results.items() if r}
    if done:
        rows = summarize(done, args.workers, servers, rate, args.ranks_per_host)
        print(format_summary(rows, args.workers, rate, args.ranks_per_host), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                for o in rows:
                    f.write(json.dumps(o) + "\n")
    return rc
