"""``redsock plan``: predicted all-reduce time per algorithm, reducer sizing, DDP steps/s, cost.

Everything is computed by :mod:`.model` from a layout and a profile; this module only parses
options, renders tables (rich), JSON, the plot of time against hosts, and Kubernetes manifests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import parse_size
from ..errors import ConfigError
from ..results import human_size
from ..testbed.netns import format_rate, parse_rate
from . import model
from .model import LABELS, Cluster, Prediction
from .profile import Profile, check_piece_bytes, load_profile

__all__ = ["Plan", "add_arguments", "make_plan", "plot_scaling", "render_text", "run"]

#: Hosts on the x axis of the scaling plot.
PLOT_HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)
#: DDP's default gradient bucket (``bucket_cap_mb=25``).
DEFAULT_BUCKET = 25 << 20
EMIT_HEADER = "# Written by `redsock plan ... --emit k8s --emit-dir DIR`: change the plan, not this file.\n"


@dataclass(frozen=True)
class Costs:
    host_per_h: float | None = None  #: price of one worker host per hour
    reducer_per_h: float | None = None  #: price of one reducer host per hour


@dataclass(frozen=True)
class Training:
    model_bytes: int  #: gradient bytes all-reduced per step
    compute_s: float  #: forward + backward of one step without communication
    bucket_bytes: int = DEFAULT_BUCKET
    overlap: float = 0.0  #: share of the shorter of compute/communication hidden behind the longer


@dataclass
class Plan:
    """The result of one ``redsock plan``: what the tables, the JSON and the manifests show."""

    cluster: Cluster  #: with the reducers used in the predictions
    nbytes: int
    profile: Profile
    predictions: list[Prediction]
    reducer_algo: str  #: "reducers" (one rank per host) or "hreducers"
    fewest_reducers: int
    reducers_given: bool
    training: Training | None = None
    costs: Costs = dataclasses.field(default_factory=Costs)

    @property
    def best(self) -> Prediction:
        return min(self.predictions, key=lambda p: p.seconds)

    def by_algo(self) -> dict[str, Prediction]:
        return {p.algo: p for p in self.predictions}

    def ddp_rows(self) -> list[dict[str, Any]]:
        """Per algorithm: steps/s, speed-up over gloo's ring, hosts paid for, cost per step."""
        t = self.training
        if t is None:
            return []
        out = []
        for p in self.predictions:
            comm = model.gradient_sync_s(p.algo, self.cluster, t.model_bytes, t.bucket_bytes, self.profile)
            step = model.ddp_step_s(comm, t.compute_s, t.overlap)
            reducers = self.cluster.reducers if p.algo in model.REDUCER_ALGORITHMS else 0
            row: dict[str, Any] = {"algo": p.algo, "label": LABELS[p.algo], "comm_s": comm, "step_s": step,
                                   "steps_per_s": 1 / step, "hosts": self.cluster.hosts, "reducers": reducers}
            c = self.costs
            if c.host_per_h is not None:
                per_h = self.cluster.hosts * c.host_per_h + reducers * (c.reducer_per_h or 0.0)
                row["cost_per_step"] = per_h / 3600 * step
            out.append(row)
        gloo = next(r for r in out if r["algo"] == "gloo")
        for r in out:
            r["speedup_vs_gloo"] = gloo["step_s"] / r["step_s"]
            if "cost_per_step" in r:
                r["cost_vs_gloo"] = r["cost_per_step"] / gloo["cost_per_step"]
        return out

    def to_json(self) -> dict[str, Any]:
        c = self.cluster
        return {
            "layout": {"hosts": c.hosts, "ranks_per_host": c.ranks_per_host, "world": c.world,
                       "link_bps": c.link_bps, "reducers": c.reducers, "reducer_link_bps": c.reducer_bps,
                       "reducer_cores": c.reducer_cores},
            "bytes": self.nbytes,
            "profile": self.profile.to_json(),
            "predictions": [p.to_json() for p in self.predictions],
            "best": self.best.algo,
            "fewest_reducers": {"algo": self.reducer_algo, "reducers": self.fewest_reducers},
            "ddp": self.ddp_rows(),
        }


def make_plan(cluster: Cluster, nbytes: int, profile: Profile, training: Training | None = None,
              costs: Costs = Costs()) -> Plan:
    """Predict every algorithm; without reducers in ``cluster``, size them (the fewest that reach,
    within 1%, the best time over any number of reducers)."""
    algo = "hreducers" if cluster.ranks_per_host > 1 else "reducers"
    fewest, _ = model.fewest_reducers(algo, cluster, nbytes, profile)
    given = cluster.reducers > 0
    c = cluster if given else cluster.with_reducers(fewest)
    return Plan(c, nbytes, profile, model.predict_all(c, nbytes, profile), algo, fewest, given, training, costs)


# ----------------------------------------------------------------------------- rendering

def _ms(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def layout_line(plan: Plan) -> str:
    c = plan.cluster
    red = (f"; {c.reducers} reducer hosts at {format_rate(c.reducer_bps)}"
           f"{f' x {c.reducer_cores} cores' if c.reducer_cores > 1 else ''}"
           f"{'' if plan.reducers_given else ' (sized by the plan)'}")
    return (f"{c.hosts} hosts x {c.ranks_per_host} ranks = {c.world} ranks, {format_rate(c.link_bps)} NICs"
            f"{red}; all-reduce of {human_size(plan.nbytes)}; profile: {plan.profile.source}")


def tables(plan: Plan) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of every table the plan prints."""
    gloo = plan.by_algo()["gloo"].seconds
    out = [("one all-reduce", ["algorithm", "time", "algbw GB/s", "busbw GB/s", "bytes / host NIC",
                               "bottleneck", "vs gloo"],
            [[LABELS[p.algo], _ms(p.seconds), f"{p.algbw_GBps:.3g}", f"{p.busbw_GBps:.3g}",
              human_size(p.nic_bytes) if p.nic_bytes else "0", p.bottleneck, f"{gloo / p.seconds:.2f}x"]
             for p in plan.predictions])]
    rows, t = plan.ddp_rows(), plan.training
    if rows and t is not None:
        costed = "cost_per_step" in rows[0]
        head = ["algorithm", "gradient sync", "step", "steps/s", "speed-up vs gloo", "hosts + reducers"]
        head += ["cost / step", "cost vs gloo"] if costed else []
        body = []
        for r in rows:
            line = [r["label"], _ms(r["comm_s"]), _ms(r["step_s"]), f"{r['steps_per_s']:.3g}",
                    f"{r['speedup_vs_gloo']:.2f}x", f"{r['hosts']} + {r['reducers']}"]
            if costed:
                line += [f"{r['cost_per_step']:.3g}", f"{r['cost_vs_gloo']:.2f}x"]
            body.append(line)
        out.append((f"DDP step: {human_size(t.model_bytes)} of gradients in {human_size(t.bucket_bytes)} buckets, "
                    f"{_ms(t.compute_s)} compute, overlap {t.overlap:.0%}", head, body))
    return out


def recommendation(plan: Plan) -> str:
    best = plan.best
    c = plan.cluster
    p = model.predict(plan.reducer_algo, c.with_reducers(plan.fewest_reducers), plan.nbytes, plan.profile)
    total = plan.fewest_reducers * c.reducer_bps
    return (f"fastest: {LABELS[best.algo]} ({_ms(best.seconds)}, {best.bottleneck}-bound). "
            f"{LABELS[plan.reducer_algo]}: {plan.fewest_reducers} reducers reach {_ms(p.seconds)} "
            f"(within 1% of the best over any number; {p.bottleneck}-bound); their links total "
            f"{format_rate(total)} against the workers' {format_rate(c.hosts * c.link_bps)}.")


def render_text(plan: Plan) -> str:
    """Plain-text form (also what the tests read)."""
    lines = [layout_line(plan), ""]
    for title, head, rows in tables(plan):
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines += [title, "  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows] + [""]
    lines.append(recommendation(plan))
    return "\n".join(lines)


def _print_rich(plan: Plan) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    con = Console() if sys.stdout.isatty() else Console(width=160)  # no wrapped cells in a pipe
    con.print(layout_line(plan))
    for title, head, rows in tables(plan):
        t = Table(title=title)
        for i, h in enumerate(head):
            t.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            t.add_row(*r)
        con.print(t)
    con.print(recommendation(plan))
    return True


def scaling(cluster: Cluster, nbytes: int, profile: Profile,
            hosts: tuple[int, ...] = PLOT_HOSTS) -> dict[str, list[tuple[int, float, int]]]:
    """Per algorithm, (hosts, seconds, reducers) as the job grows; reducers sized per point
    (the fewest within 1% of unlimited) unless the cluster fixes them."""
    out: dict[str, list[tuple[int, float, int]]] = {}
    for h in hosts:
        c = cluster.with_hosts(h)
        if c.reducers == 0:
            algo = "hreducers" if c.ranks_per_host > 1 else "reducers"
            c = c.with_reducers(model.fewest_reducers(algo, c, nbytes, profile)[0])
        for p in model.predict_all(c, nbytes, profile):
            m = c.reducers if p.algo in model.REDUCER_ALGORITHMS else 0
            out.setdefault(p.algo, []).append((h, p.seconds, m))
    return out


def plot_scaling(cluster: Cluster, nbytes: int, profile: Profile, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = scaling(cluster, nbytes, profile)
    fig, ax = plt.subplots(figsize=(8, 5))
    for algo, pts in data.items():
        ax.plot([h for h, _, _ in pts], [t * 1e3 for _, t, _ in pts], marker="o", label=LABELS[algo])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(PLOT_HOSTS, [str(h) for h in PLOT_HOSTS])
    ax.set_xlabel("hosts")
    ax.set_ylabel(f"time of one {human_size(nbytes)} all-reduce (ms)")
    sized = "reducers sized per point" if cluster.reducers == 0 else f"{cluster.reducers} reducers"
    ax.set_title(f"{cluster.ranks_per_host} ranks/host, {format_rate(cluster.link_bps)} NICs, {sized}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the command

def _positive_float(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number, got {text!r}") from None
    if not v > 0:
        raise ConfigError(f"{what} must be > 0, got {text!r}")
    return v


def _size(text: str, option: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise ConfigError(f"{option} wants a size like 64M, 1.5G or 1048576, not {text!r}") from None


def apply_overrides(profile: Profile, sets: list[str] | None) -> Profile:
    """``--set NAME=VALUE`` (any profile field, e.g. ``intra_Bps=200e9`` for NVLink hosts)."""
    changes: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(Profile)} - {"source"}
    for item in sets or []:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise ConfigError(f"--set wants NAME=VALUE with NAME one of {', '.join(sorted(names))}; got {item!r}")
        changes[name] = _positive_float(value, f"--set {name}")
        if name == "piece_bytes":
            changes[name] = int(changes[name])
            check_piece_bytes(changes[name], "--set")
    if not changes:
        return profile
    return dataclasses.replace(profile, **changes,
                               source=profile.source + " + " + ", ".join(f"{k}={v:g}" for k, v in changes.items()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, help="worker hosts H (required unless --lab)")
    p.add_argument("--ranks-per-host", type=int, default=1, metavar="L", help="ranks (GPUs) per host (default 1)")
    p.add_argument("--link", metavar="RATE", help="each worker host's NIC, e.g. 100gbit (required unless --lab)")
    p.add_argument("--reducers", type=int, default=0, metavar="M",
                   help="reducer hosts (default: the fewest that reach the best time)")
    p.add_argument("--reducer-link", metavar="RATE", help="each reducer's NIC (default: as --link)")
    p.add_argument("--reducer-cores", type=int, default=1, metavar="C",
                   help="cores a reducer host's work spreads over (that many reducer processes; default 1)")
    p.add_argument("--bytes", default="64M", metavar="SIZE", help="all-reduce size (default 64M)")
    p.add_argument("--profile", metavar="FILE", help="constants from `redsock calibrate` (default: built-in)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="override one profile constant (repeatable), e.g. intra_Bps=200e9")
    g = p.add_argument_group("training step (DDP)")
    g.add_argument("--model-bytes", metavar="SIZE", help="gradient bytes per step (e.g. 1.3G for fp32 325M params)")
    g.add_argument("--step-compute-ms", type=float, help="forward+backward time of one step without communication")
    g.add_argument("--bucket-bytes", default="25M", metavar="SIZE", help="DDP bucket size (default 25M)")
    g.add_argument("--overlap", type=float, default=0.0,
                   help="share 0..1 of the shorter of compute and gradient sync hidden behind the longer")
    g.add_argument("--price-host", type=float, metavar="PER_HOUR", help="price of a worker host per hour")
    g.add_argument("--price-reducer", type=float, metavar="PER_HOUR", help="price of a reducer host per hour")
    p.add_argument("--lab", metavar="DIR",
                   help="instead: predict every all-reduce `redsock reproduce` measured (its results/ DIR), "
                        "next to the measurement (markdown)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the plan as JSON ('-': standard output, no tables)")
    o.add_argument("--plot", metavar="FILE.png", help="plot time against hosts (8..1024) per algorithm")
    o.add_argument("--emit", choices=["k8s"], help="print Kubernetes manifests sized by the plan (no tables)")
    from .k8s import add_arguments as add_k8s_arguments

    add_k8s_arguments(o)


def plan_from_args(args: argparse.Namespace) -> Plan:
    if args.hosts is None or args.link is None:
        raise ConfigError("give --hosts and --link (or --lab DIR)")
    cluster = Cluster(args.hosts, args.ranks_per_host, parse_rate(args.link), args.reducers,
                      parse_rate(args.reducer_link) if args.reducer_link else None, args.reducer_cores)
    nbytes = _size(args.bytes, "--bytes")
    profile = apply_overrides(load_profile(args.profile), args.set)
    training = None
    if (args.model_bytes is None) != (args.step_compute_ms is None):
        raise ConfigError("--model-bytes and --step-compute-ms go together")
    if args.model_bytes is not None:
        if args.step_compute_ms < 0:
            raise ConfigError("--step-compute-ms must be >= 0")
        training = Training(_size(args.model_bytes, "--model-bytes"), args.step_compute_ms / 1e3,
                            _size(args.bucket_bytes, "--bucket-bytes"), args.overlap)
        if training.model_bytes < 1:
            raise ConfigError("--model-bytes must be >= 1")
        model.ddp_step_s(0.0, 0.0, training.overlap)  # checks the range
    if (args.price_reducer is not None) and args.price_host is None:
        raise ConfigError("--price-reducer needs --price-host")
    for v in (args.price_host, args.price_reducer):
        if v is not None and v < 0:
            raise ConfigError("prices must be >= 0")
    if args.price_host is not None and training is None:
        raise ConfigError("a cost per step needs a step: give --model-bytes and --step-compute-ms")
    return make_plan(cluster, nbytes, profile, training, Costs(args.price_host, args.price_reducer))


def run(args: argparse.Namespace) -> int:
    if args.lab:
        from . import lab

        profile = apply_overrides(load_profile(args.profile), args.set)
        print(f"profile: {profile.source}\n")
        print(lab.markdown(lab.check_rows(lab.load_lab(args.lab), profile)))
        ddp = lab.ddp_checks(args.lab, profile)
        if ddp:
            print("\nDDP training (compute per step from gloo's measured step):\n")
            print(lab.ddp_markdown(ddp))
        return 0
    plan = plan_from_args(args)
    if args.emit == "k8s":
        from .k8s import file_yaml, manifests_from_args, to_yaml

        files = manifests_from_args(plan.cluster, args)
        if not args.emit_dir:
            sys.stdout.write(to_yaml(files))
            return 0
        out = Path(args.emit_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, objs in files.items():
            (out / name).write_text(file_yaml(objs, EMIT_HEADER))
            print(f"wrote {out / name}")
        return 0
    if args.json == "-":
        json.dump(plan.to_json(), sys.stdout, indent=2)
        print()
    else:
        if not _print_rich(plan):
            print(render_text(plan))
        if args.json:
            Path(args.json).write_text(json.dumps(plan.to_json(), indent=2) + "\n")
            print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_scaling(plan.cluster if plan.reducers_given else plan.cluster.with_reducers(0), plan.nbytes, plan.profile, args.plot)}",
              file=sys.stderr if args.json == "-" else sys.stdout)
    return 0
