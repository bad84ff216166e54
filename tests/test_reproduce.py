"""``redsock reproduce``: bounds and ratios (closed form), the report's tables and failure
sections (synthetic results), the step runner (failing and overdue benchmarks), and
one small end-to-end run through real namespaces (root, ~30 s)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from redsock import reproduce as R
from redsock import results as report
from redsock.errors import ConfigError, RedsockError
from redsock.reproduce import tables
from redsock.testbed import cleanup_prefix, list_prefix_netns

IS_ROOT = os.geteuid() == 0
MiB = 1 << 20
GBIT = 1_000_000_000
GOODPUT = GBIT * 0.956 / 8 / 1e9  # 0.1195 GB/s


def ar_row(algo: str, world: int, nbytes: int, algbw: float, *, impl: str | None = None,
           profile: str = "uniform", rate: int = GBIT) -> report.Row:
    """A testbed row whose algbw is ``algbw`` GB/s (time = bytes / algbw)."""
    return report.Row.from_times(
        impl or ("gloo" if algo == "gloo" else "redsock"), algo, world, nbytes, nbytes // 4, "float32", "sum",
        [nbytes / 1e9 / algbw],
        extra={"testbed": {"workers": world, "servers": world, "rate_bps": rate, "profile": profile,
                           "goodput_factor": 0.956}})


def step(key: str, section: str, series: dict[str, str] | None = None, world: int = 4, **kw: Any) -> R.Step:
    return R.Step(key, section, key, ("bench", "allreduce"), 60.0, world=world, series=series or {}, **kw)


def tagged(rows: list[report.Row], st: R.Step) -> list[report.Row]:
    return R.tag_rows(rows, st)


# ---------------------------------------------------------------- bounds (closed form)

def test_bounds_and_ideal_ratios() -> None:
    assert R.link_goodput_GBps(GBIT) == pytest.approx(0.1195)
    # A ring sends 2S(N-1)/N per worker: at N=4 that is 1.5 S, so algbw <= goodput / 1.5.
    assert R.algbw_bound_GBps("ring", 4, GBIT) == pytest.approx(0.1195 / 1.5)
    assert R.algbw_bound_GBps("gloo", 8, GBIT) == pytest.approx(0.1195 / 1.75)
    assert R.algbw_bound_GBps("ring", 2, GBIT) == pytest.approx(0.1195)
    # Reducers: S out and S in whatever N.
    assert R.algbw_bound_GBps("server", 8, GBIT) == pytest.approx(0.1195)
    assert R.ideal_over_gloo("server", 2) == pytest.approx(1.0)
    assert R.ideal_over_gloo("server", 4) == pytest.approx(1.5)
    assert R.ideal_over_gloo("server", 8) == pytest.approx(1.75)
    assert R.ideal_over_gloo("ring", 8) == pytest.approx(1.0)
    assert R.ideal_over_gloo("gloo", 8) is None
    assert R.latency_growth_model("ring", 2, 8) == pytest.approx(7.0)   # 2(N-1) steps: 14 / 2
    assert R.latency_growth_model("auto", 2, 8) == pytest.approx(3.0)   # log2 N: 3 / 1
    assert R.latency_growth_model("server", 2, 8) == pytest.approx(1.0)
    assert R.latency_growth_model("gloo", 2, 8) is None
    with pytest.raises(ConfigError):
        R.traffic_factor("ring", 1)


# ---------------------------------------------------------------- transport

def transport_row(impl: str, balance: str, gbps: float, nbytes: int = 64 * MiB, nsocks: int = 4) -> dict[str, Any]:
    return {"impl": impl, "mode": "throughput", "bytes": nbytes, "nsocks": nsocks if impl == "redsock" else 1,
            "balance": balance, "iters": 4, "median_s": nbytes * 8 / gbps / 1e9, "min_s": 0.1, "gbps": gbps,
            "extra": {"rates": [800e6, 600e6, 400e6, 200e6], "goodput_factor": 0.956,
                      "classes_hit": [0, 1, 2, 3] if impl == "redsock" else [0]}}


def test_transport_ratios_and_table() -> None:
    rows = [transport_row("plain", "-", 0.72), transport_row("redsock", "static", 0.75),
            transport_row("redsock", "dynamic", 1.8)]
    pts = R.transport_points(rows)
    assert [p.label.split(" x")[0] for p in pts] == ["Fast Socket, dynamic slicing", "static even split (NCCL socket)",
                                                     "one socket (fastest class)"]
    dyn = pts[0]
    assert dyn.bound_gbps == pytest.approx(2.0 * 0.956)          # the classes' summed rate x goodput
    assert dyn.of_bound == pytest.approx(1.8 / 1.912)
    assert dyn.over_static == pytest.approx(2.4)
    assert dyn.over_one_socket == pytest.approx(2.5)
    assert pts[1].over_static is None and pts[2].over_one_socket is None
    table = R.transport_table(pts)
    assert "| 64 MiB | Fast Socket, dynamic slicing x4 | 0,1,2,3 | 1.800 | 1.912 | 94.1% | 2.40x | 2.50x |" in table
    assert "| 64 MiB | one socket (fastest class) | 0 | 0.720 | 1.912 | 37.7% | - | - |" in table


def test_transport_row_without_rates_is_refused() -> None:
    bad = transport_row("redsock", "dynamic", 1.0)
    del bad["extra"]["rates"]
    with pytest.raises(ConfigError, match="rates"):
        R.transport_points([bad])


# ---------------------------------------------------------------- all-reduce

def with_extra(r: report.Row, **extra: object) -> report.Row:
    return dataclasses.replace(r, extra={**r.extra, **extra})


def allreduce_rows() -> list[report.Row]:
    main = step("allreduce-n4", "allreduce", {"gloo": "gloo", "ring": "ring", "server": "server"})
    one = step("ring1-n4", "allreduce", {"ring": "ring1"})
    ring_bound = GOODPUT / 1.5
    return (tagged([ar_row("gloo", 4, 64 * MiB, 0.8 * ring_bound),
                    ar_row("ring", 4, 64 * MiB, 0.9 * ring_bound),
                    with_extra(ar_row("server", 4, 64 * MiB, 0.9 * GOODPUT), machine_busy=0.812)], main)
            + tagged([ar_row("ring", 4, 64 * MiB, 0.6 * ring_bound)], one))


def test_allreduce_points_bounds_and_ratios() -> None:
    groups = R.allreduce_points(allreduce_rows())
    assert list(groups) == [("uniform", 4)]
    pts = {p.series: p for p in groups[("uniform", 4)]}
    assert [p.series for p in groups[("uniform", 4)]] == ["gloo", "ring1", "ring", "server"]
    assert pts["gloo"].of_bound == pytest.approx(0.8)
    assert pts["ring"].of_bound == pytest.approx(0.9)
    assert pts["server"].of_bound == pytest.approx(0.9)
    assert pts["server"].bound_GBps == pytest.approx(GOODPUT)
    # Reducers at 0.9 of goodput against gloo at 0.8 of goodput/1.5: 0.9 * 1.5 / 0.8.
    assert pts["server"].over_gloo == pytest.approx(1.6875)
    assert pts["server"].ideal_over_gloo == pytest.approx(1.5)
    assert pts["ring"].over_gloo == pytest.approx(0.9 / 0.8)
    assert pts["ring"].over_one_socket == pytest.approx(1.5)
    assert pts["ring1"].over_one_socket is None and pts["gloo"].over_gloo is None

    table = R.allreduce_table(groups[("uniform", 4)])
    server = pts["server"].row
    line = next(x for x in table.splitlines() if "| redsock reducers |" in x)
    assert line == (f"| 64 MiB | redsock reducers | {tables.us(server.median_s)} | {server.algbw_GBps:.4f} "
                    f"| {server.busbw_GBps:.4f} | 0.1195 | 90.0% | 1.69x | 1.50x | - | 81% |")  # (machine busy)
    assert next(x for x in table.splitlines() if "| gloo |" in x).endswith("| - | - |")  # (no reading: older rows)
    assert "| 64 MiB | redsock ring, Fast Socket |" in table and "| 1.50x |" in table


def test_rows_without_testbed_metadata_are_refused() -> None:
    r = report.Row.from_times("gloo", "gloo", 4, MiB, MiB // 4, "float32", "sum", [0.01])
    with pytest.raises(ConfigError, match="testbed"):
        R.allreduce_points(R.tag_rows([r], step("x", "allreduce")))


def test_latency_table_growth_against_the_model() -> None:
    rows = []
    for n, ring_us, server_us in ((2, 100, 300), (4, 300, 310), (8, 700, 330)):
        st = step(f"latency-n{n}", "latency", {"ring": "ring", "server": "server"}, world=n)
        rows += tagged([ar_row("ring", n, 8, 8 / 1e9 / (ring_us * 1e-6)),
                        ar_row("server", n, 8, 8 / 1e9 / (server_us * 1e-6))], st)
    table = R.latency_table(rows)
    assert "| size | series | N=2 (µs) | N=4 (µs) | N=8 (µs) | N=8 / N=2 | model |" in table
    assert "| 8 B | redsock ring, Fast Socket | 100.0 | 300.0 | 700.0 | 7.00x | 7.00x |" in table
    assert "| 8 B | redsock reducers | 300.0 | 310.0 | 330.0 | 1.10x | 1.00x |" in table
    one = R.latency_table([r for r in rows if r.world == 2])
    assert "N=2 / N=2" not in one and "| 8 B | redsock ring, Fast Socket | 100.0 |" in one


# ---------------------------------------------------------------- DDP

def ddp_obj(algo: str, sps: float, workers: int = 4, servers: int = 0) -> dict[str, Any]:
    hosts = workers + servers
    return {"algo": algo, "backend": "gloo" if algo == "gloo" else "redsock", "workers": workers,
            "servers": servers, "rate_bps": GBIT, "steps": 20, "time_s": 20 / sps, "steps_per_s": sps,
            "final_loss": 7.25, "grad_bytes": 30_000_000, "hosts": hosts, "host_s_per_step": hosts / sps}


def ddp_objs() -> list[dict[str, Any]]:
    return [ddp_obj("server", 1.4, servers=4), ddp_obj("gloo", 1.0), ddp_obj("ring", 1.1)]


def test_ddp_ratios_cost_and_comm_bound() -> None:
    pts = {p["algo"]: p for p in R.ddp_points(ddp_objs())}
    assert [p["algo"] for p in R.ddp_points(ddp_objs())] == ["gloo", "ring", "server"]
    assert pts["server"]["over_gloo"] == pytest.approx(1.4)
    assert pts["server"]["ideal_over_gloo"] == pytest.approx(1.5)
    # 8 hosts at 1.4 steps/s against 4 hosts at 1.0: 5.714 / 4 host-seconds per step.
    assert pts["server"]["cost_over_gloo"] == pytest.approx((8 / 1.4) / 4)
    # Gradient bytes over link goodput: 119.5 MB/s / 30 MB (reducers), / (1.5 x 30 MB) (ring).
    assert pts["server"]["comm_bound_steps_per_s"] == pytest.approx(119.5e6 / 30e6)
    assert pts["gloo"]["comm_bound_steps_per_s"] == pytest.approx(119.5e6 / 45e6)
    assert pts["gloo"]["over_gloo"] is None and pts["gloo"]["ideal_over_gloo"] is None
    table = R.ddp_table(R.ddp_points(ddp_objs()))
    assert "| 4 | server | redsock | 4 | 1.400 | 1.40x | 1.50x | 3.983 | 35% | 8 | 5.714 | 1.43x | 7.2500 |" in table


def test_ddp_results_must_follow_the_contract() -> None:
    bad = ddp_objs()
    del bad[0]["host_s_per_step"]
    with pytest.raises(ConfigError, match="host_s_per_step"):
        R.ddp_points(bad)


# ---------------------------------------------------------------- the report

def run_info(settings: R.Settings) -> R.RunInfo:
    return R.RunInfo(settings, {"CPU": "test CPU", "cores": "2"}, datetime(2025, 1, 2, 3, 4, tzinfo=timezone.utc),
                     61.0, "/usr/bin/python3", "rsrptest")


def test_report_has_every_section_and_says_what_failed() -> None:
    s = R.PLANS["quick"]
    rows = allreduce_rows()
    main = step("allreduce-n4", "allreduce")
    results = [
        R.StepResult(step("transport", "transport"), "failed", 1, 12.0,
                     error="results unreadable\nTraceback ...\nRedsockError: listener died"),
        R.StepResult(main, "ok", 0, 30.0, data=[r for r in rows if r.extra["step"] == "allreduce-n4"]),
        R.StepResult(step("ring1-n4", "allreduce"), "ok", 0, 10.0,
                     data=[r for r in rows if r.extra["step"] == "ring1-n4"]),
        R.StepResult(step("latency-n4", "latency"), "timeout", -15, 120.0, error="still running after 120 s"),
        R.StepResult(step("ddp-n4", "ddp"), "failed", 1, 20.0, error="RedsockError: gloo run 1 failed"),
    ]
    md = R.render_markdown(run_info(s), results)
    for head in ("## Machine", "## Settings", "## Summary", "## 1. Fast Socket", "## 2. All-reduce",
                 "## 2b. All-reduce under per-flow", "## 3. Small-message latency", "## 4. DDP", "## Commands run"):
        assert head in md
    assert "| CPU | test CPU |" in md and "2025-01-02 03:04 UTC" in md
    assert "Generated by `redsock reproduce --quick` (quick mode)" in md
    # Failures say what failed, with the stderr tail, in their own section and in the summary.
    assert "**FAILED:** `transport`" in md and "RedsockError: listener died" in md
    assert "**TIMEOUT:** `latency-n4`" in md and "still running after 120 s" in md
    assert "**FAILED:** `ddp-n4`" in md and "gloo run 1 failed" in md
    assert "| ddp-n4 | **failed** (see its section) | - |" in md
    assert "Not run (opt-in). Caveat" in md  # the per-flow all-reduce
    # The measured numbers are the rows' numbers.
    server = next(r for r in rows if r.algo == "server")
    assert f"| {server.algbw_GBps:.4f} | {server.busbw_GBps:.4f} | 0.1195 | 90.0% | 1.69x | 1.50x |" in md
    assert "| Reducers vs gloo algbw (N=4, 64 MiB) | 1.69x; reducers at 90% of link goodput | ideal 1.50x" in md
    assert "| Fast Socket ring vs 1 socket (N=4, 64 MiB) | 1.50x" in md
    # Every command is listed as run.
    assert "| transport | failed | 1 | 12 |" in md and "| ddp-n4 | failed | 1 | 20 |" in md


def test_report_with_ddp_results() -> None:
    res = [R.StepResult(step("ddp-n4", "ddp"), "ok", 0, 50.0, data=ddp_objs())]
    md = R.render_markdown(run_info(R.PLANS["quick"]), res)
    assert "| DDP training speed-up, reducers vs gloo (N=4) | 1.40x steps/s; cost per step 1.43x gloo's (8 hosts)" in md
    assert "| DDP training speed-up, redsock ring vs gloo (N=4) | 1.10x steps/s; cost per step 0.91x gloo's" in md
    assert "| 4 | gloo | gloo | 0 | 1.000 |" in md


def test_figures_are_written(tmp_path: Path) -> None:
    rows = allreduce_rows()
    results = [R.StepResult(step("transport", "transport"), "ok", 0, 1.0,
                            data=[transport_row("redsock", "dynamic", 1.8), transport_row("redsock", "static", 0.75),
                                  transport_row("plain", "-", 0.72)]),
               R.StepResult(step("allreduce-n4", "allreduce"), "ok", 0, 1.0, data=rows),
               R.StepResult(step("latency-n4", "latency"), "ok", 0, 1.0, data=rows),
               R.StepResult(step("ddp-n4", "ddp"), "ok", 0, 1.0, data=ddp_objs())]
    info = run_info(R.PLANS["full"])
    R.write_figures(info, results, tmp_path)
    assert info.figure_errors == {}
    assert set(info.figures.values()) == {"transport.png", "allreduce.png", "latency.png", "ddp.png"}
    for name in info.figures.values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- plan and options

def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    R.add_arguments(p)
    return p.parse_args(argv)


def test_quick_plan_measures_every_claim(tmp_path: Path) -> None:
    s = R.settings_from_args(parse(["--quick"]))
    steps = {st.key: st for st in R.make_plan(s, tmp_path, "rsrpx")}
    assert list(steps) == ["transport", "allreduce-n2", "ring1-n2", "latency-n2", "allreduce-n4", "ring1-n4",
                           "latency-n4", "multirank-h4x2", "multirank-ring-h4x2", "ddp-n4"]
    ring1 = steps["ring1-n4"]
    assert ring1.env == {"REDSOCK_NSOCKS": "1"} and ring1.series == {"ring": "ring1"}
    argv = list(ring1.argv)
    assert argv[argv.index("--servers") + 1] == "0" and argv[argv.index("--algo") + 1] == "ring"
    assert argv[argv.index("--json") + 1] == str(tmp_path / "ring1-n4.jsonl")
    main = list(steps["allreduce-n4"].argv)
    assert main[main.index("--algo") + 1] == "gloo,ring,server" and steps["allreduce-n4"].env["REDSOCK_NSOCKS"] == "4"
    assert "--prefix" in main and main[main.index("--prefix") + 1] == "rsrpx"
    lat = list(steps["latency-n4"].argv)
    assert lat[lat.index("--algo") + 1] == "ring,auto,server,gloo"
    ddp = list(steps["ddp-n4"].argv)
    assert ddp[:3] == ["bench", "ddp", "--testbed"] and ddp[ddp.index("--prefix") + 1] == "rsrpx"
    assert ddp[ddp.index("--workers") + 1] == "4" and ddp[ddp.index("--servers") + 1] == "4"
    assert ddp[ddp.index("--algos") + 1] == "gloo,ring,server"
    assert sum(st.timeout_s for st in steps.values()) < 3600
    assert "REDSOCK_NSOCKS=1 python -m redsock bench allreduce --testbed --workers 4 --servers 0" in ring1.command()


def test_full_plan_has_n8_and_per_flow_all_reduce_is_opt_in(tmp_path: Path) -> None:
    keys = [st.key for st in R.make_plan(R.settings_from_args(parse([])), tmp_path, "rsrpx")]
    assert {"transport", "allreduce-n8", "ring1-n8", "latency-n8", "ddp-n4", "ddp-n8"} <= set(keys)
    assert not [k for k in keys if k.startswith("perflow")]
    only = R.make_plan(R.settings_from_args(parse(["--only", "perflow"])), tmp_path, "rsrpx")
    assert [st.key for st in only] == ["perflow-n4", "perflow-ring1-n4"]
    assert dict(only[1].env) == {"REDSOCK_NSOCKS": "1"} and "perflow" in only[1].argv


@pytest.mark.parametrize("plan", sorted(R.PLANS))
def test_every_step_is_a_valid_command(plan: str, tmp_path: Path) -> None:
    """Each step's argv parses with the real ``redsock`` parser, so a typo shows here
    rather than 20 minutes into a full run."""
    from redsock.cli import build_parser

    parser = build_parser()
    for st in R.make_plan(R.PLANS[plan], tmp_path, "rsrpx"):
        args = parser.parse_args(list(st.argv))
        assert args.json == str(tmp_path / st.json_name)


def test_invocation_names_the_overrides() -> None:
    assert R.invocation(R.PLANS["full"]) == "redsock reproduce"
    s = R.settings_from_args(parse(["--quick", "--only", "allreduce", "--workers", "2", "--rate", "2gbit"]))
    assert R.invocation(s) == "redsock reproduce --quick --only allreduce --workers 2 --rate 2gbit"
    assert R.invocation(R.PLANS["smoke"]) == "redsock reproduce --plan smoke"


@pytest.mark.parametrize("argv, match", [
    (["--only", "transport,nope"], "unknown section"),
    (["--workers", "1,4"], "2..100"),
    (["--workers", "two"], "counts like"),
    (["--rate", "5MB"], "bad rate"),
])
def test_bad_options_are_config_errors(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        R.settings_from_args(parse(argv))


def test_bad_prefix_and_no_root_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="prefix"):
        R.run(parse(["--prefix", "Bad-Prefix", "--out", str(tmp_path)]))
    from redsock.testbed import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(RedsockError, match="needs root"):
        R.run(parse(["--quick", "--out", str(tmp_path)]))
    assert not (tmp_path / "results.md").exists()


# ---------------------------------------------------------------- the step runner (no root)

def test_failing_step_is_reported_with_its_stderr(tmp_path: Path) -> None:
    st = R.Step("bad", "allreduce", "bad", ("bench", "allreduce", "--no-such-option"), 60.0)
    r = R.run_step(st, tmp_path)
    assert r.status == "failed" and r.rc == 2 and "--no-such-option" in r.error
    assert r.data == []


def test_overdue_step_is_stopped(tmp_path: Path) -> None:
    # A reduction server serves until stopped: the runner stops it at the deadline.
    st = R.Step("slow", "transport", "slow", ("serve", "--host", "127.0.0.1", "--port", "0"), 3.0)
    r = R.run_step(st, tmp_path)
    assert r.status == "timeout" and "still running after 3 s" in r.error
    assert 3.0 <= r.wall_s < 40


# ---------------------------------------------------------------- end to end (root)

@pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root")
@pytest.mark.timeout(150)
def test_smoke_run_writes_report_plots_and_raw_json(tmp_path: Path) -> None:
    prefix = f"rsrq{os.getpid() % 100000}"
    out = tmp_path / "docs"
    argv = [sys.executable, "-m", "redsock", "reproduce", "--plan", "smoke", "--out", str(out),
            "--prefix", prefix, "--no-progress"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=140, check=False)
    finally:
        leftover = list_prefix_netns(prefix)
        cleanup_prefix(prefix)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{(out / 'results.md').read_text()}"
    assert leftover == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert prefix not in listed

    md = (out / "results.md").read_text()
    res = out / "results"
    for name in ("transport.png", "allreduce.png", "latency.png"):
        assert (res / name).stat().st_size > 1000
        assert f"(results/{name})" in md
    # The report's numbers are the raw JSON's numbers.
    for key, series in (("allreduce-n2", {"gloo": "gloo", "ring": "ring", "server": "server"}),
                        ("ring1-n2", {"ring": "ring1"})):
        rows = report.read_json(res / f"{key}.jsonl")
        assert {r.algo for r in rows} == set(series)
        for r in rows:
            assert r.extra["testbed"]["workers"] == 2
            cells = (f"| {report.human_size(r.bytes)} | {R.SERIES_LABELS[series[r.algo]]} | {tables.us(r.median_s)} "
                     f"| {r.algbw_GBps:.4f} | {r.busbw_GBps:.4f} |")
            assert cells in md, cells
    lat = report.read_json(res / "latency-n2.jsonl")
    assert {r.algo for r in lat} == {"ring", "auto", "server", "gloo"}
    for r in lat:
        assert f"| 8 B | {R.SERIES_LABELS[r.algo]} | {tables.us(r.median_s)} |" in md
    for t in map(json.loads, (res / "transport.jsonl").read_text().splitlines()):
        assert f"| {t['gbps']:.3f} |" in md
    assert "REDSOCK_NSOCKS=1 python -m redsock bench allreduce" in md
    assert "| ring1-n2 | ok | 0 |" in md


def test_report_keeps_the_plan_section_from_the_stored_results() -> None:
    """Regenerating results.md writes the model's comparison from the run's raw outputs."""
    stored = Path(__file__).resolve().parents[1] / "docs" / "results"
    md = R.render_markdown(run_info(R.PLANS["quick"]), [], stored)
    assert "## The model (`redsock plan`) against these measurements" in md
    assert "Link-bound points within 15%:" in md and "| 8 x 1 | 0 | 64 MiB | gloo |" in md
    assert "| workers | algo | compute / step (from gloo) |" in md  # the DDP comparison
    assert "## The model" not in R.render_markdown(run_info(R.PLANS["quick"]), [])
