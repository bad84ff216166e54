"""Several ranks per host in the testbed benchmarks (``--ranks-per-host L``).

Without root: torchrun's numbering of the ranks on the hosts, the torchrun variables
each rank gets, the host-link bounds of DESIGN.md section 7 against their closed
forms, the option parsing of ``bench allreduce --testbed`` / ``bench ddp --testbed``,
the summaries and the ``reproduce`` section.  With root: ranks really start in their
hosts' namespaces, and a 2 hosts x 2 ranks + 2 reducers all-reduce sweep is right
(``--check``: 0 wrong, bitwise-identical ranks) and leaves no namespace behind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from redsock import reproduce as R
from redsock import results as report
from redsock.bench import allreduce, ddp_testbed
from redsock.bench.allreduce import testbed as allreduce_testbed
from redsock.bench.bounds import host_nic_factor
from redsock.errors import ConfigError
from redsock.reproduce import tables
from redsock.testbed import RankSlot, Testbed, list_prefix_netns, place_ranks
from redsock.testbed.launch import rank_env, start_ranks, stop, wait_ranks

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root")
MiB = 1 << 20
RATE = 300_000_000
GOODPUT = RATE * 0.956 / 8 / 1e9


# ---------------------------------------------------------------- placement

def test_ranks_are_consecutive_on_each_host_as_torchrun_numbers_them() -> None:
    slots = place_ranks(["w0", "w1", "w2", "w3"], 2)
    assert [(s.rank, s.host, s.local_rank, s.local_world) for s in slots] == [
        (0, "w0", 0, 2), (1, "w0", 1, 2), (2, "w1", 0, 2), (3, "w1", 1, 2),
        (4, "w2", 0, 2), (5, "w2", 1, 2), (6, "w3", 0, 2), (7, "w3", 1, 2)]
    assert [s.label for s in slots[:3]] == ["w0.0", "w0.1", "w1.0"]
    # One rank per host: rank i on w<i>, the labels (log names) as before.
    assert [(s.rank, s.host, s.label) for s in place_ranks(["w0", "w1"], 1)] == [(0, "w0", "w0"), (1, "w1", "w1")]
    three = place_ranks(["a", "b"], 3)
    assert [s.host for s in three] == ["a"] * 3 + ["b"] * 3 and [s.local_rank for s in three] == [0, 1, 2, 0, 1, 2]
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="ranks per host"):
            place_ranks(["w0"], bad)
    with pytest.raises(ConfigError, match="no hosts"):
        place_ranks([], 2)


def test_every_rank_gets_the_torchrun_variables_of_its_slot() -> None:
    tb = Testbed(workers=4, servers=2, rate="300mbit", prefix="rphx")  # no system calls until up()
    slots = tb.rank_slots(2)
    assert len(slots) == 8
    env = rank_env(tb, slots[3], len(slots), master_port=29555)
    assert env == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "198.18.0.1", "MASTER_PORT": "29555", "GLOO_SOCKET_IFNAME": "eth0",
                   "REDSOCK_SERVERS": "198.18.0.101:7700,198.18.0.102:7700"}
    assert "REDSOCK_SERVERS" not in rank_env(Testbed(workers=2, prefix="rphy"), RankSlot(0, "w0", 0, 1), 2)


# ---------------------------------------------------------------- bounds (closed forms)

@pytest.mark.parametrize("hosts, per", [(4, 2), (2, 2), (4, 3), (8, 1), (3, 4)])
def test_host_link_bytes_match_the_closed_forms(hosts: int, per: int) -> None:
    n = hosts * per
    assert host_nic_factor("gloo", n, hosts) == pytest.approx(2 * (n - 1) / n)
    assert host_nic_factor("ring", n, hosts) == pytest.approx(2 * (n - 1) / n)
    assert host_nic_factor("ring", n, hosts, "hierarchical") == pytest.approx(2 * (hosts - 1) / hosts)
    assert host_nic_factor("server", n, hosts) == pytest.approx(per)
    assert host_nic_factor("server", n, hosts, "hierarchical") == pytest.approx(1.0)
    # The ideal ratios against gloo's flat ring are the byte ratios.
    assert allreduce_testbed.ideal_over_gloo("server", n, hosts, "hierarchical") == pytest.approx(2 * (n - 1) / n)
    assert allreduce_testbed.ideal_over_gloo("server", n, hosts) == pytest.approx(2 * (n - 1) / n / per)
    assert R.ideal_over_gloo("ring", n, hosts, "hierarchical") == pytest.approx((n - 1) / n * hosts / (hosts - 1))
    assert R.algbw_bound_GBps("server", n, RATE, hosts=hosts, scheme="hierarchical") == pytest.approx(GOODPUT)


def test_the_issue_figures_4_hosts_x_2_ranks() -> None:
    # 4 hosts x 2 ranks: gloo 1.75 S per host link, hierarchical reducers S: 1.75x; the
    # hierarchical ring 1.5 S: 1.17x; flat reducers 2 S: 0.875x (0.83x measured in the issue).
    assert allreduce_testbed.ideal_over_gloo("server", 8, 4, "hierarchical") == pytest.approx(1.75)
    assert allreduce_testbed.ideal_over_gloo("ring", 8, 4, "hierarchical") == pytest.approx(1.75 / 1.5)
    assert allreduce_testbed.ideal_over_gloo("server", 8, 4) == pytest.approx(0.875)
    assert allreduce_testbed.ideal_over_gloo("ring", 8, 4) == pytest.approx(1.0)
    # 32 MiB at 300 Mbit/s: gloo's bound 1.75 x 32 MiB / goodput = 1.64 s, as the issue measured.
    assert 1.75 * 32 * MiB / 1e9 / GOODPUT == pytest.approx(1.637, abs=0.005)


def test_bounds_refuse_what_has_none() -> None:
    assert host_nic_factor("auto", 8, 4) is None and host_nic_factor("small", 8, 4) is None
    assert host_nic_factor("ring", 2, 1) is None  # one host: no link crossed
    with pytest.raises(ConfigError, match="evenly"):
        host_nic_factor("ring", 7, 2)
    with pytest.raises(ConfigError, match="scheme"):
        host_nic_factor("ring", 8, 4, "tree")
    with pytest.raises(ConfigError):
        R.traffic_factor("ring", 4, 1)


# ---------------------------------------------------------------- options

def _parse_allreduce(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    allreduce.add_arguments(p)
    return p.parse_args(argv)


def test_allreduce_option_parses_and_stays_with_the_launcher() -> None:
    args = _parse_allreduce(["--testbed", "--workers", "4", "--ranks-per-host", "2", "-b", "32M", "--check"])
    assert (args.workers, args.ranks_per_host) == (4, 2)
    assert _parse_allreduce(["--testbed"]).ranks_per_host == 1  # --workers keeps meaning hosts = ranks
    argv = allreduce_testbed.child_argv(args, "/tmp/rows.jsonl")
    assert "--ranks-per-host" not in argv and "--workers" not in argv and "--check" in argv


def test_ddp_option_parses() -> None:
    p = argparse.ArgumentParser()
    ddp_testbed.add_arguments(p)
    args = p.parse_args(["--testbed", "--workers", "4", "--ranks-per-host", "2"])
    assert (args.workers, args.ranks_per_host) == (4, 2)
    assert p.parse_args(["--testbed"]).ranks_per_host == 1


@pytest.mark.parametrize("cmd", [["bench", "allreduce", "--testbed"], ["bench", "ddp", "--testbed"]])
def test_bad_ranks_per_host_is_refused_before_anything_starts(cmd: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "redsock", *cmd, "--ranks-per-host", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--ranks-per-host must be >= 1" in r.stderr, r.stderr


# ---------------------------------------------------------------- summaries

def _row(algo: str, algbw: float, scheme: str | None = None, nbytes: int = 64 * MiB, world: int = 8,
         inter: str | None = None) -> report.Row:
    extra = {"scheme": scheme, "inter": inter or algo} if scheme else {}
    return report.Row.from_times("gloo" if algo == "gloo" else "redsock", algo, world, nbytes, nbytes // 4,
                                 "float32", "sum", [nbytes / 1e9 / algbw], 0, extra=extra)


def test_allreduce_summary_uses_each_schemes_host_link_bound() -> None:
    gloo_bound = GOODPUT / 1.75
    rows = [_row("gloo", 0.9 * gloo_bound), _row("server", 0.8 * GOODPUT, "hierarchical"),
            _row("ring", 0.9 * GOODPUT / 1.5, "hierarchical")]
    text = allreduce_testbed.summary_table(rows, RATE, 4, 4, "uniform", ranks_per_host=2)
    assert "4 workers x 2 ranks (N=8), 4 reducers" in text
    lines = {x.split()[1]: x.split() for x in text.splitlines() if "MiB" in x and not x.startswith("#")}
    # size, algo, route, time, algbw, NIC/S, bound, %bound, gloo, /gloo, ideal, #wrong
    assert lines["gloo"][2:3] + lines["gloo"][5:8] == ["flat:ring", "1.75", f"{gloo_bound:.4f}", "90.0%"]
    assert lines["server"][2:3] + lines["server"][5:8] == ["hier:server", "1.00", f"{GOODPUT:.4f}", "80.0%"]
    assert lines["server"][9:11] == [f"{0.8 * 1.75 / 0.9:.2f}", "1.75"]
    assert lines["ring"][5] == "1.50" and lines["ring"][10] == f"{1.75 / 1.5:.2f}"
    # A row that says nothing was flat: the reducers' bound is then L x S per host link.
    flat = allreduce_testbed.summary_table([_row("server", 0.5 * GOODPUT)], RATE, 4, 4, "uniform", 2)
    line = next(x for x in flat.splitlines() if "server" in x and not x.startswith("#")).split()
    assert line[2] == "flat:server" and line[5] == "2.00" and line[7] == "100.0%"
    # "auto" is bounded by what the ranks chose: here reducers between hosts after a host reduction.
    auto = allreduce_testbed.summary_table([_row("auto", 0.5 * GOODPUT, "hierarchical", inter="server")],
                                           RATE, 4, 4, "uniform", 2)
    line = next(x for x in auto.splitlines() if "auto" in x and not x.startswith("#")).split()
    assert line[2] == "hier:server" and line[5] == "1.00" and line[10] == "1.75"


def test_ddp_summary_counts_hosts_and_ranks() -> None:
    run = {"steps": 10, "time_s": 5.0, "steps_per_s": 2.0, "final_loss": 9.0, "grad_bytes": 30_000_000,
           "tcp": {"TCPTimeouts": 0}, "machine_busy": 0.95, "machine_steal": 0.1}
    rows = ddp_testbed.summarize({"gloo": [run], "server": [{**run, "steps_per_s": 3.0}]}, workers=4, servers=4,
                                 rate=RATE, ranks_per_host=2)
    gloo, server = rows
    assert (gloo["world"], gloo["ranks_per_host"], gloo["workers"], gloo["hosts"]) == (8, 2, 4, 4)
    assert server["hosts"] == 8 and server["vs_gloo"] == pytest.approx(1.5) and server["machine_busy"] == 0.95
    text = ddp_testbed.format_summary(rows, 4, RATE, 2)
    assert "4 workers x 2 ranks (N=8)" in text and " 95%" in text
    # reproduce's DDP bound: gradient bytes x bytes per host link (flat: gloo 1.75, reducers L = 2).
    pts = {p["algo"]: p for p in R.ddp_points(rows)}
    assert pts["gloo"]["comm_bound_steps_per_s"] == pytest.approx(GOODPUT * 1e9 / (1.75 * 30e6))
    assert pts["server"]["comm_bound_steps_per_s"] == pytest.approx(GOODPUT * 1e9 / (2 * 30e6))
    assert pts["server"]["ideal_over_gloo"] == pytest.approx(0.875)
    hier = R.ddp_points([{**o, "scheme": "hierarchical"} if o["algo"] == "server" else o for o in rows])
    assert next(p for p in hier if p["algo"] == "server")["ideal_over_gloo"] == pytest.approx(1.75)


# ---------------------------------------------------------------- reproduce's section

def test_reproduce_section_plans_and_reports_two_ranks_per_host(tmp_path: Path) -> None:
    s = R.PLANS["full"]
    st = next(x for x in R.make_plan(s, tmp_path, "rsrpx") if x.section == "multirank")
    argv = list(st.argv)
    assert st.key == "multirank-h4x2" and st.world == 8
    assert argv[argv.index("--workers") + 1] == "4" and argv[argv.index("--ranks-per-host") + 1] == "2"
    assert argv[argv.index("--servers") + 1] == "4" and argv[argv.index("--rate") + 1] == "150mbit"
    assert argv[argv.index("--algo") + 1] == "gloo,auto,server"
    ring = next(x for x in R.make_plan(s, tmp_path, "rsrpx") if x.key == "multirank-ring-h4x2")
    rargv = list(ring.argv)
    assert rargv[rargv.index("--servers") + 1] == "0" and rargv[rargv.index("--algo") + 1] == "gloo,auto,ring"
    assert ring.series == {"gloo": "gloo2", "auto": "auto-ring", "ring": "ring"}
    from redsock.cli import build_parser

    assert build_parser().parse_args(argv).ranks_per_host == 2
    meta = {"workers": 4, "servers": 4, "rate_bps": RATE, "profile": "uniform", "goodput_factor": 0.956,
            "ranks_per_host": 2}
    def rows_of(step: R.Step, *rows: report.Row) -> list[report.Row]:
        return R.tag_rows([replace(r, extra={**r.extra, "testbed": meta}) for r in rows], step)

    rows = rows_of(st, _row("gloo", 0.9 * GOODPUT / 1.75), _row("auto", 0.8 * GOODPUT, "hierarchical", inter="server"),
                   _row("server", 0.7 * GOODPUT / 2, "flat"))
    rows += rows_of(ring, _row("gloo", 0.8 * GOODPUT / 1.75), _row("auto", 0.9 * GOODPUT / 1.5, "hierarchical",
                                                                   inter="ring"), _row("ring", 0.8 * GOODPUT / 1.75, "flat"))
    pts = {p.series: p for p in R.allreduce_points(rows)[("uniform", 8)]}
    assert pts["gloo"].bound_GBps == pytest.approx(GOODPUT / 1.75) and pts["gloo"].of_bound == pytest.approx(0.9)
    hier = pts["auto-servers"]
    assert hier.bound_GBps == pytest.approx(GOODPUT) and hier.ideal_over_gloo == pytest.approx(1.75)
    assert hier.label == "redsock auto, reducers set: hierarchical, reducers between hosts"
    assert hier.over_gloo == pytest.approx(0.8 * 1.75 / 0.9)  # against the gloo of its own run
    assert pts["server"].bound_GBps == pytest.approx(GOODPUT / 2) and pts["server"].ideal_over_gloo == pytest.approx(0.875)
    assert pts["auto-ring"].bound_GBps == pytest.approx(GOODPUT / 1.5)
    assert pts["auto-ring"].over_gloo == pytest.approx(0.9 * 1.75 / 1.5 / 0.8)  # its run's gloo, not the first's
    assert pts["ring"].over_gloo == pytest.approx(1.0) and pts["gloo2"].over_gloo is None
    info = R.RunInfo(s, {"CPU": "test"}, datetime(2026, 1, 1, tzinfo=timezone.utc), 60.0, "python", "rsrpx")
    md = R.render_markdown(info, [R.StepResult(st, "ok", 0, 90.0, data=rows[:3], cpu_pct=97),
                                  R.StepResult(ring, "ok", 0, 80.0, data=rows[3:], cpu_pct=95)])
    assert "## 5. Several ranks per host" in md and "### 4 hosts x 2 ranks = 8 ranks, 4 reducer hosts" in md
    assert "used 97% of all cores" in md
    assert (f"| {hier.label} vs gloo's flat ring (4 hosts x 2 ranks, 64 MiB) | "
            f"{0.8 * 1.75 / 0.9:.2f}x; at 80% of its bound | ideal 1.75x (bytes per host link: gloo 1.75 S, "
            "this 1.00 S)") in md
    assert f"| 64 MiB | {hier.label} | {tables.us(hier.row.median_s)} |" in md
    assert "| 64 MiB | gloo (run without reducers) |" in md


# ---------------------------------------------------------------- in the namespaces (root)

@needs_root
def test_ranks_start_in_their_hosts_namespaces(tmp_path: Path) -> None:
    prefix = f"rsph{os.getpid() % 100000}"
    probe = ("import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], "
             "os.environ['WORLD_SIZE'], os.stat('/proc/self/ns/net').st_ino)")
    tb = Testbed(workers=2, servers=0, rate="1gbit", prefix=prefix)
    try:
        tb.up()
        ranks, relays = start_ranks(tb, [sys.executable, "-c", probe], tmp_path, ranks_per_host=2)
        assert wait_ranks(ranks, [], float("inf"), 30) is None
        stop(ranks)
        for t in relays:
            t.join(timeout=5)
        seen = {}
        for p in ranks:
            out = (tmp_path / f"{p.name}.log").read_text().split()
            seen[p.name] = tuple(map(int, out))
        ns = {h: os.stat(f"/run/netns/{tb.ns(h)}").st_ino for h in ("w0", "w1")}
        assert seen == {"w0.0": (0, 0, 2, 4, ns["w0"]), "w0.1": (1, 1, 2, 4, ns["w0"]),
                        "w1.0": (2, 0, 2, 4, ns["w1"]), "w1.1": (3, 1, 2, 4, ns["w1"])}
    finally:
        tb.down()
    assert not list_prefix_netns(prefix)


@needs_root
def test_two_ranks_per_host_all_reduce_is_right_and_cleans_up(tmp_path: Path) -> None:
    prefix = f"rspr{os.getpid() % 100000}"
    out = tmp_path / "rows.jsonl"
    argv = [sys.executable, "-m", "redsock", "bench", "allreduce", "--testbed", "--workers", "2",
            "--ranks-per-host", "2", "--servers", "2", "--rate", "1gbit", "--prefix", prefix, "--tcp-cc", "reno",
            "-b", "4K", "-e", "1M", "-f", "16", "-n", "2", "-w", "1", "--algo", "server,ring,auto,gloo", "--check",
            "--json", str(out), "--timeout", "120"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert {r["algo"] for r in rows} == {"server", "ring", "auto", "gloo"}
        assert {r["bytes"] for r in rows} == {4096, 65536, 1 << 20}
        for r in rows:  # 0 wrong against the float64 reference, every rank bitwise identical
            assert r["world"] == 4 and r["wrong"] == 0, r
            assert r["extra"]["testbed"]["ranks_per_host"] == 2 and r["extra"]["testbed"]["workers"] == 2
        assert "2 workers x 2 ranks (N=4), 2 reducers" in proc.stdout and "# CPU over" in proc.stdout
    finally:
        left = list_prefix_netns(prefix)
        if left:
            subprocess.run([sys.executable, "-m", "redsock", "testbed", "down", "--prefix", prefix],
                           capture_output=True)
    assert not left, f"namespaces left behind: {left}"
