"""redsock plan: the model against closed forms (DESIGN.md section 7's bytes per host NIC,
reproduce's link bounds), reducer sizing, DDP steps/s and cost, profiles, the command."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from redsock.cli import main
from redsock.config import SMALLEST_PIECE_BYTES
from redsock.errors import ConfigError
from redsock.plan import DEFAULT, Cluster, Profile, fewest_reducers, lab, load_profile, model, predict, predict_all
from redsock.plan.command import make_plan, plot_scaling
from redsock.results import Row
from redsock.testbed import netns

S = 64 << 20
G = 100e9
# A profile in which only the links cost anything: the time is the NIC bytes over goodput.
LINKS_ONLY = dataclasses.replace(DEFAULT, gloo_step_s=1e-12, redsock_step_s=1e-12, reducer_hop_s=1e-12,
                                 reducer_cpu_s_per_byte=1e-30, reduce_Bps=1e30, intra_Bps=1e30,
                                 loopback_Bps=1e30, piece_bytes=1)
# The same with pieces as small as a configuration allows (REDSOCK_PIECE_BYTES >= 4 KiB): a
# search over the number of reducers tries every M up to one piece each.
LINKS_ONLY_4K = dataclasses.replace(LINKS_ONLY, piece_bytes=SMALLEST_PIECE_BYTES)


def goodput(bps: float, p: Profile = DEFAULT) -> float:
    return bps * p.goodput_factor / 8


@pytest.mark.parametrize("hosts,L", [(2, 1), (4, 1), (8, 1), (4, 2), (3, 4), (16, 8)])
def test_bytes_per_host_nic_follow_the_contract(hosts: int, L: int) -> None:
    n = hosts * L
    c = Cluster(hosts, L, G, reducers=4)
    by = {p.algo: p for p in predict_all(c, S, DEFAULT)}
    assert by["gloo"].nic_bytes == pytest.approx(2 * S * (n - 1) / n)
    assert by["ring"].nic_bytes == pytest.approx(2 * S * (n - 1) / n)
    assert by["reducers"].nic_bytes == pytest.approx(L * S)
    if L > 1:
        assert by["hring"].nic_bytes == pytest.approx(2 * S * (hosts - 1) / hosts)
        assert by["hreducers"].nic_bytes == pytest.approx(S)
    else:
        assert "hring" not in by and "hreducers" not in by


@pytest.mark.parametrize("n", [2, 4, 8])
def test_link_bound_times_are_reproduces_bounds(n: int) -> None:
    rate = 1e9
    c = Cluster(n, 1, rate, reducers=n)
    ring = predict("gloo", c, S, LINKS_ONLY)
    red = predict("reducers", c, S, LINKS_ONLY)
    assert ring.seconds == pytest.approx(2 * S * (n - 1) / n / goodput(rate), rel=1e-9)
    assert red.seconds == pytest.approx(S / goodput(rate), rel=1e-6)
    assert ring.seconds / red.seconds == pytest.approx(2 * (n - 1) / n, rel=1e-6)  # the ideal speed-up
    assert ring.bottleneck == red.bottleneck == "host NIC"


def test_latency_terms_count_steps() -> None:
    p = dataclasses.replace(DEFAULT, gloo_step_s=1e-3, redsock_step_s=2e-3, reducer_hop_s=5e-3)
    for n, rd_steps in [(2, 1), (4, 2), (8, 3), (6, 2 + 2), (5, 2 + 2)]:
        c = Cluster(n, 1, G, reducers=2)
        assert predict("gloo", c, 8, p).latency_s == pytest.approx(2 * (n - 1) * 1e-3)
        assert predict("rd", c, 8, p).latency_s == pytest.approx(rd_steps * 2e-3)
        assert predict("reducers", c, 8, p).latency_s == pytest.approx(2 * 5e-3)  # 2 hops whatever N


@pytest.mark.parametrize("hosts,L", [(4, 2), (8, 4), (16, 1), (6, 1), (3, 2)])
def test_recursive_doubling_crossings_brute_force(hosts: int, L: int) -> None:
    n = hosts * L
    p2 = 1 << (n.bit_length() - 1)
    rounds, fold = model._rd_crossings(hosts, L)  # noqa: SLF001
    assert len(rounds) == int(math.log2(p2))
    if L & (L - 1) == 0 and n == p2:  # powers of two: log2(H) rounds cross, each with all L ranks
        assert sum(rounds) == L * int(math.log2(hosts))
    pred = predict("rd", Cluster(hosts, L, G), S, LINKS_ONLY)
    assert pred.nic_bytes == pytest.approx(S * (sum(rounds) + 2 * fold))


def test_seed_example_sizes_reducers_like_vertex() -> None:
    """5 hosts x 100 Gbit/s, 32 Gbit/s reducers: reducers' total >= workers' total -> 16."""
    c = Cluster(5, 8, 100e9, reducer_link_bps=32e9)
    for algo in ("hreducers", "reducers"):
        m, pred = fewest_reducers(algo, c, S, LINKS_ONLY_4K, within=0.0)
        assert m == math.ceil(5 * (100e9 if algo == "hreducers" else 100e9) / 32e9) == 16
        assert predict(algo, c.with_reducers(m - 1), S, LINKS_ONLY_4K).seconds > pred.seconds


def test_fewest_reducers_searches_as_far_as_a_small_piece_cap_reaches() -> None:
    """With pieces capped below MIN_PIECE_BYTES (REDSOCK_PIECE_BYTES=16K), a 256 KiB message is
    16 pieces: up to 16 reducers share them, not the 4 that 64 KiB pieces would fill."""
    p = dataclasses.replace(DEFAULT, piece_bytes=16 * 1024)
    c = Cluster(4, 1, 100e9, reducer_link_bps=1e9)
    m, pred = fewest_reducers("reducers", c, 256 * 1024, p)
    assert m > 4 and pred.seconds < predict("reducers", c.with_reducers(4), 256 * 1024, p).seconds
    assert m <= 16


def test_time_never_grows_with_reducers() -> None:
    c = Cluster(8, 4, 100e9, reducer_link_bps=25e9)
    times = [predict("hreducers", c.with_reducers(m), S, DEFAULT).seconds for m in range(1, 80)]
    assert all(a >= b for a, b in zip(times, times[1:]))


def test_ddp_step_and_cost() -> None:
    assert model.ddp_step_s(0.3, 0.2, 0.0) == pytest.approx(0.5)
    assert model.ddp_step_s(0.3, 0.2, 1.0) == pytest.approx(0.3)
    assert model.ddp_step_s(0.3, 0.2, 0.5) == pytest.approx(0.4)
    with pytest.raises(ConfigError):
        model.ddp_step_s(0.3, 0.2, 1.5)
    c = Cluster(4, 1, 1e9, reducers=4)
    bucket = 25 << 20
    total = 2 * bucket + 1000
    sync = model.gradient_sync_s("gloo", c, total, bucket, DEFAULT)
    assert sync == pytest.approx(2 * predict("gloo", c, bucket, DEFAULT).seconds
                                 + predict("gloo", c, 1000, DEFAULT).seconds)
    from redsock.plan.command import Costs, Training

    plan = make_plan(c, S, DEFAULT, Training(total, 0.1), Costs(2.0, 0.5))
    rows = {r["algo"]: r for r in plan.ddp_rows()}
    red = rows["reducers"]
    assert red["cost_per_step"] == pytest.approx((4 * 2.0 + 4 * 0.5) / 3600 * red["step_s"])
    assert rows["gloo"]["speedup_vs_gloo"] == 1.0
    assert red["speedup_vs_gloo"] == pytest.approx(rows["gloo"]["step_s"] / red["step_s"])


def test_bad_layouts_are_refused() -> None:
    for kw in ({"hosts": 0}, {"ranks_per_host": 0}, {"link_bps": 0}, {"reducers": -1},
               {"reducer_link_bps": -5.0}, {"reducer_cores": 0}, {"burst_bytes": -1}):
        args = {"hosts": 4, "ranks_per_host": 1, "link_bps": G, **kw}
        with pytest.raises(ConfigError):
            Cluster(**args)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        Cluster(1, 1, G)
    with pytest.raises(ConfigError, match="reducers >= 1"):
        predict("reducers", Cluster(4, 1, G), S, DEFAULT)
    with pytest.raises(ConfigError, match="unknown algorithm"):
        predict("butterfly", Cluster(4, 1, G), S, DEFAULT)
    with pytest.raises(ConfigError):
        predict("gloo", Cluster(4, 1, G), 0, DEFAULT)


def test_profile_round_trip_and_errors(tmp_path: Path) -> None:
    p = dataclasses.replace(DEFAULT, reduce_Bps=1.5e9, source="test")
    path = p.save(tmp_path / "p.json")
    assert load_profile(path) == p
    assert load_profile(None) == DEFAULT
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"version": 1, "redsock_step_s": 1e-5}))
    assert load_profile(partial) == dataclasses.replace(DEFAULT, redsock_step_s=1e-5)
    for text, msg in [("{", "not JSON"), ('{"bogus": 1}', "unknown field"), ('{"reduce_Bps": -1}', "positive"),
                      ('{"version": 9}', "version"), ('{"goodput_factor": 1.5}', "goodput"),
                      ('{"piece_bytes": 1000}', ">= 4096")]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load_profile(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hosts", "4", "--link", "1gbit", "--bytes", "64M", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["world"] == 4 and out["fewest_reducers"]["algo"] == "reducers"
    algos = [p["algo"] for p in out["predictions"]]
    assert algos == ["gloo", "ring", "rd", "reducers"]
    gloo = out["predictions"][0]
    assert gloo["seconds"] == pytest.approx(predict("gloo", Cluster(4, 1, 1e9), S, DEFAULT).seconds)


def test_plan_command_tables_ddp_and_costs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--hosts", "5", "--ranks-per-host", "8", "--link", "100gbit", "--reducer-link", "32gbit",
            "--model-bytes", "1G", "--step-compute-ms", "200", "--price-host", "30", "--price-reducer", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for text in ("hierarchical reducers", "steps/s", "cost / step", "reducers reach"):
        assert text in out


@pytest.mark.parametrize("argv,msg", [
    (["--hosts", "0", "--link", "1gbit"], "hosts"),
    (["--hosts", "4", "--link", "100gbps"], "bad rate"),
    (["--hosts", "4", "--link", "1gbit", "--bytes", "lots"], ""),
    (["--hosts", "4", "--link", "1gbit", "--model-bytes", "1G"], "go together"),
    (["--hosts", "4", "--link", "1gbit", "--price-host", "3"], "needs a step"),
    (["--hosts", "4", "--link", "1gbit", "--set", "warp=9"], "NAME=VALUE"),
    (["--hosts", "4", "--link", "1gbit", "--set", "intra_Bps=-1"], "> 0"),
    (["--hosts", "4", "--link", "1gbit", "--set", "piece_bytes=1000"], ">= 4096"),
    (["--hosts", "4", "--link", "1gbit", "--profile", "/nonexistent.json"], "cannot read"),
])
def test_plan_command_errors(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_plot_scaling(tmp_path: Path) -> None:
    path = plot_scaling(Cluster(8, 8, 100e9, reducer_link_bps=32e9), S, DEFAULT, tmp_path / "s.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(series: str, world: int, nbytes: int, seconds: float, servers: int = 0) -> Row:
    algo = {"ring1": "ring"}.get(series, series)
    return Row("redsock", algo, world, nbytes, nbytes // 4, "float32", "sum", seconds, seconds, seconds,
               nbytes / seconds / 1e9, 0.0, extra={"series": series, "testbed": {
                   "rate_bps": 1e9, "servers": servers, "goodput_factor": 0.956}})


def test_lab_classifies_and_judges() -> None:
    link = predict("gloo", Cluster(4, 1, 1e9), S, DEFAULT).seconds
    rows = [_row("gloo", 4, S, link * 1.05),  # link-bound, 5% off: within 15%
            _row("server", 4, S, link * 2, servers=4),  # link-bound, far off: a miss
            _row("server", 8, S, 1.0, servers=8),  # 16 processes on 2 cores: CPU-bound, not judged
            _row("auto", 4, 8, 1e-3)]  # 8 bytes: latency-bound, not judged
    checks = lab.check_rows(rows, DEFAULT, cores=2)
    assert [c.kind for c in checks] == ["link-bound", "link-bound", "CPU-bound", "latency-bound"]
    assert [c.ok for c in checks] == [True, False, None, None]
    assert checks[0].error == pytest.approx(1 / 1.05 - 1)
    assert checks[3].prediction.algo == "rd"
    text = lab.markdown(checks)
    assert "Link-bound points within 15%: 1 of 2" in text


_CPU_LINE = "# CPU over 54.1 s: ranks 50.4 s, reducers 10.8 s (= 57% of 2 cores); whole machine busy {}% (includes ...)"


def _lab_dir(d: Path, run_busy: int, row_busy: Callable[[dict], float | None]) -> Path:
    """docs/results' N=4 rows in ``d``, each with ``row_busy(row)`` as its own machine_busy
    (None: none, as rows written before they had one), and a log whose CPU line says ``run_busy``%."""
    src = Path(__file__).parent.parent / "docs" / "results" / "allreduce-n4.jsonl"
    d.mkdir()
    lines = []
    for line in src.read_text().splitlines():
        row = json.loads(line)
        row["extra"].pop("machine_busy", None)
        if (busy := row_busy(row)) is not None:
            row["extra"]["machine_busy"] = busy
        lines.append(json.dumps(row))
    (d / src.name).write_text("\n".join(lines) + "\n")
    (d / "allreduce-n4.log").write_text(f"# reducer s0: peak RSS 60.1 MiB\n{_CPU_LINE.format(run_busy)}\n")
    return d


def test_lab_classes_a_run_that_kept_the_machine_busy_as_cpu_bound(tmp_path: Path) -> None:
    """Rows without a reading of their own take the run's busy share, from the benchmark's CPU
    line in the log beside them; a run at 75% or more is CPU-bound whatever its process count."""
    kinds = {}
    for busy in (60, 75):
        rows = lab.load_lab(_lab_dir(tmp_path / str(busy), busy, lambda row: None))
        assert {r.extra["machine_busy"] for r in rows} == {busy / 100}
        kinds[busy] = {c.kind for c in lab.check_rows(rows, DEFAULT, cores=2) if c.row.bytes >= 16 << 20}
    assert "link-bound" in kinds[60] and kinds[75] == {"CPU-bound"}


def test_lab_takes_a_rows_own_machine_busy_over_its_runs(tmp_path: Path) -> None:
    """A run's CPU line averages over every series and size; a row's own reading, taken while
    it was timed, decides: the reducers' 64 MiB rows at 80% are CPU-bound in a run at 60%,
    and rows at 50% stay link-bound in a run at 90%."""
    big = 64 << 20

    def reducers_busy(row: dict) -> float:
        return 0.8 if row["bytes"] == big and row["algo"] == "server" else 0.5

    rows = lab.load_lab(_lab_dir(tmp_path / "a", 60, reducers_busy))
    kinds = {(c.series, c.row.bytes): c.kind for c in lab.check_rows(rows, DEFAULT, cores=2)}
    assert kinds[("server", big)] == "CPU-bound"
    assert kinds[("gloo", big)] == "link-bound"
    rows = lab.load_lab(_lab_dir(tmp_path / "b", 90, lambda row: 0.5))
    assert {r.extra["machine_busy"] for r in rows} == {0.5}
    assert "link-bound" in {c.kind for c in lab.check_rows(rows, DEFAULT, cores=2) if c.row.bytes >= 16 << 20}


def test_lab_classes_a_point_whose_ranks_kept_the_cores_busy_as_cpu_bound() -> None:
    """A run's CPU line averages over every size: a point whose own ranks kept the cores 75%
    busy while it was timed (``ranks_busy``, per row) is CPU-bound even in a quiet run."""
    link = predict("gloo", Cluster(4, 1, 1e9), S, DEFAULT).seconds

    def row(busy: float) -> Row:
        r = _row("server", 4, S, link * 2, servers=4)
        return dataclasses.replace(r, extra={**r.extra, "ranks_busy": busy, "machine_busy": 0.5})

    checks = lab.check_rows([row(0.74), row(0.75)], DEFAULT, cores=2)
    assert [c.kind for c in checks] == ["link-bound", "CPU-bound"]
    assert [c.ok for c in checks] == [False, None]


def test_lab_several_ranks_per_host_use_the_hierarchical_model() -> None:
    def row(series: str, servers: int = 0) -> Row:
        r = _row(series, 8, S, 1.0, servers)
        return dataclasses.replace(r, extra={**r.extra, "testbed": {**r.extra["testbed"], "ranks_per_host": 2}})

    checks = lab.check_rows([row("gloo"), row("ring"), row("server", 4)], DEFAULT, cores=2)
    assert [c.prediction.algo for c in checks] == ["gloo", "hring", "hreducers"]
    assert [c.cluster.hosts for c in checks] == [4, 4, 4]
    assert checks[2].prediction.nic_bytes == pytest.approx(S)  # one copy per host NIC


def test_lab_reads_the_multirank_runs_with_their_series_and_routes() -> None:
    # docs/results holds reproduce's multirank files: both auto series are kept apart
    # and each is predicted for the route its rows recorded.
    checks = [c for c in lab.check_rows(lab.load_lab(Path(__file__).parent.parent / "docs" / "results"), DEFAULT)
              if c.cluster.ranks_per_host == 2]
    algos = {c.series: c.prediction.algo for c in checks}
    assert algos == {"gloo": "gloo", "gloo2": "gloo", "ring": "ring", "server": "reducers",
                     "auto-servers": "hreducers", "auto-ring": "hring"}, algos
    assert {c.row.bytes for c in checks} == {32 << 20, 64 << 20}


def test_lab_ddp_takes_compute_from_gloo_and_predicts_the_rest(tmp_path: Path) -> None:
    c = Cluster(4, 1, 1e9, reducers=4, burst_bytes=netns.burst_bytes(int(1e9)))  # the testbed's links
    grad = 30_000_000
    compute = 0.1
    steps = {a: 1 / (compute + model.gradient_sync_s(m, c, grad, lab.DDP_BUCKET, DEFAULT))
             for a, m in (("gloo", "gloo"), ("server", "reducers"))}
    rows = [{"algo": "gloo", "backend": "gloo", "workers": 4, "servers": 0, "rate_bps": 1e9, "grad_bytes": grad,
             "steps_per_s": steps["gloo"]},
            {"algo": "server", "backend": "redsock", "workers": 4, "servers": 4, "rate_bps": 1e9, "grad_bytes": grad,
             "steps_per_s": steps["server"] / 1.1}]
    for r in rows:  # the rest of what bench ddp writes
        r.update(steps=25, time_s=25 / r["steps_per_s"], final_loss=9.1, hosts=4 + r["servers"],
                 host_s_per_step=(4 + r["servers"]) / r["steps_per_s"])
    (tmp_path / "ddp-n4.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    checks = lab.ddp_checks(tmp_path, DEFAULT, cores=2)
    assert [c.algo for c in checks] == ["gloo", "server"]
    assert checks[0].compute_s == pytest.approx(compute)
    assert checks[1].predicted_steps_s == pytest.approx(steps["server"])
    assert checks[1].error == pytest.approx(0.1)


@pytest.mark.parametrize("n,m,nbytes,per_pair", [(2, 2, 4 << 20, 2), (4, 4, 16 << 20, 1), (4, 2, 1 << 20, 2),
                                                  (8, 4, 64 << 10, 1)])
def test_reducers_fill_and_drain(n: int, m: int, nbytes: int, per_pair: int) -> None:
    """Pieces as server_client cuts them.  A reducer holds its first whole piece only once a
    worker's link has sent one piece on every stream it uses at once (``per_pair`` per reducer:
    4 streams shared by the m connections, at most the pieces each reducer gets; one control
    stream for a piece that goes inline), so the reducers' NICs start that late (fill).  After
    the upload, each reducer sends its last piece to every worker and each worker receives the
    last piece of every reducer it used (drain)."""
    from redsock.collectives.server_client import piece_elements

    p = dataclasses.replace(LINKS_ONLY, piece_bytes=256 * 1024)
    piece = piece_elements(nbytes // 4, 4, m, p.piece_bytes) * 4
    used = min(m, -(-nbytes // piece))
    pred = predict("reducers", Cluster(n, 1, 1e9, reducers=m), nbytes, p)
    g = goodput(1e9, p)
    host, reducer = nbytes / g, n * nbytes / used / g
    fill, drain = used * per_pair * piece / g, max(n, used) * piece / g
    assert pred.seconds == pytest.approx(max(max(host, reducer) + drain, fill + reducer), rel=1e-6)
    assert pred.link_share == pytest.approx(1.0, rel=1e-6)  # the fill and the drain are NIC time too
    # Links with the testbed's token bucket make up for idling, up to a burst each: a reducer's
    # for the fill, a host's for what is left of the drain (before its next call's upload).
    burst = netns.burst_bytes(int(1e9))
    lab = predict("reducers", Cluster(n, 1, 1e9, reducers=m, burst_bytes=burst), nbytes, p)
    b = burst / g
    idle = max(max(host, reducer) + drain, max(0.0, fill - b) + reducer) - max(host, reducer)
    assert lab.seconds == pytest.approx(max(host, reducer) + max(0.0, idle - b), rel=1e-6)
    assert predict("ring", Cluster(n, 1, 1e9, burst_bytes=burst), nbytes, p).seconds == \
        predict("ring", Cluster(n, 1, 1e9), nbytes, p).seconds  # a ring's links never idle mid-call


def test_fewest_reducers_is_the_best_time_not_the_most_reducers() -> None:
    """Past one piece per reducer, more reducers only add last pieces to drain."""
    c = Cluster(4, 1, 1e9)
    m, pred = fewest_reducers("reducers", c, 1 << 20, DEFAULT, within=0.0)
    times = [predict("reducers", c.with_reducers(k), 1 << 20, DEFAULT).seconds for k in range(1, 65)]
    assert pred.seconds == pytest.approx(min(times)) and times.index(min(times)) + 1 == m
