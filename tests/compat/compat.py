"""``make compat``: torch's own distributed test suite on redsock, next to gloo in the same run.

For each world size (2 and 3):

1. gloo, the whole suite (the reference: what passes for gloo on CPU here);
2. redsock, the whole suite, with redsock in the suite's CPU feature sets (see ``suite.py``);
3. redsock again on the tests that step 2 skipped but gloo ran, with the suite's gates on
   the name "gloo" pointed at redsock (``--gate gloo``).

Prints passed / failed / skipped for each, every redsock skip with its reason, and every
test that passes for gloo but not for redsock (none is the goal; a failure whose cause is
torch's and not redsock's is listed with that cause).  Exit status 1 if any such test
fails for a reason of redsock's.  Each run's results are written to ``out/compat/``.

    python tests/compat/compat.py [--world-sizes 2,3] [-k SUBSTRING] [--out out/compat]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent

# Tests that cannot pass on a backend registered from Python, for reasons in torch itself.
TORCH_LIMITS = {
    "test_monitored_barrier_gloo":
        "torch.distributed.monitored_barrier() refuses every backend but gloo (distributed_c10d.py: "
        "'monitored_barrier is only implemented for GLOO backend'); ProcessGroup.monitored_barrier is "
        "redsock's and passes test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_gloo_subgroup":
        "the same check in torch.distributed.monitored_barrier()",
    "test_monitored_barrier_failure_order":
        "the same check in torch.distributed.monitored_barrier()",
    "test_monitored_barrier_wait_all_ranks":
        "the same check in torch.distributed.monitored_barrier()",
}


def run_suite(backend: str, world: int, out: Path, *, gate: str | None = None, only: list[str] | None = None,
              substring: str = "") -> dict:
    """One run of ``torch_suite.py``; its per-test log goes to a file beside the JSON."""
    label = f"{backend}{'-gate-' + gate if gate else ''}-w{world}"
    result, log = out / f"{label}.json", out / f"{label}.log"
    cmd = [sys.executable, str(HERE / "torch_suite.py"), "--backend", backend, "--world-size", str(world),
           "--json", str(result)]
    if gate:
        cmd += ["--gate", gate]
    if only is not None:
        names = out / f"{label}.only.json"
        names.write_text(json.dumps(only))
        cmd += ["--only-file", str(names)]
    if substring:
        cmd += ["-k", substring]
    env = {**os.environ, "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}
    started = time.monotonic()
    with log.open("w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    if not result.exists():
        raise SystemExit(f"{label}: the runner wrote no results; see {log}")
    data = json.loads(result.read_text())
    print(f"  {label:24} {_counts(data['tests'])}  ({time.monotonic() - started:.0f}s, log {log})", flush=True)
    return data["tests"]


def _counts(tests: dict) -> str:
    c = defaultdict(int)
    for rec in tests.values():
        c[rec["outcome"]] += 1
    return f"{c['passed']:4d} passed {c['failed']:3d} failed {c['skipped']:4d} skipped"


def compare(world: int, gloo: dict, redsock: dict, gated: dict) -> tuple[list[str], list[str]]:
    """Tests gloo passes that redsock does not: (redsock's, torch's) — printed with reasons."""
    ours, torchs = [], []
    final = {**redsock, **gated}
    for name, rec in sorted(gloo.items()):
        if rec["outcome"] != "passed" or final.get(name, {}).get("outcome") == "passed":
            continue
        got = final.get(name, {"outcome": "not run"})
        if name in TORCH_LIMITS:
            torchs.append(name)
            print(f"    torch's: {name}: {got['outcome']} — {TORCH_LIMITS[name]}")
        else:
            ours.append(name)
            detail = (got.get("detail") or "").strip().splitlines()
            print(f"    FAILED: {name}: {got['outcome']}{': ' + detail[-1][:200] if detail else ''}")
    skipped = defaultdict(list)
    for name, rec in sorted(final.items()):
        if rec["outcome"] == "skipped":
            skipped[rec.get("detail", "")].append(name)
    print(f"  world {world}: redsock's skips, by reason ({sum(map(len, skipped.values()))}):")
    for reason, names in sorted(skipped.items(), key=lambda kv: -len(kv[1])):
        also = sum(1 for n in names if gloo.get(n, {}).get("outcome") == "skipped")
        print(f"    {len(names):4d}  {reason}  (gloo skips {also} of them too)")
        print(f"          {', '.join(names)}")
    return ours, torchs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,3")
    p.add_argument("-k", dest="substring", default="", help="only tests whose name contains this")
    p.add_argument("--out", default="out/compat")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary = []
    for world in [int(w) for w in args.world_sizes.split(",")]:
        print(f"world size {world}:", flush=True)
        gloo = run_suite("gloo", world, out, substring=args.substring)
        redsock = run_suite("redsock", world, out, substring=args.substring)
        behind_gate = [n for n, r in redsock.items()
                       if r["outcome"] == "skipped" and gloo.get(n, {}).get("outcome") == "passed"]
        gated = run_suite("redsock", world, out, gate="gloo", only=behind_gate) if behind_gate else {}
        ours, torchs = compare(world, gloo, redsock, gated)
        summary.append((world, gloo, redsock, gated, ours, torchs))
    print(f"\nSummary ({time.monotonic() - started:.0f}s):")
    print(f"  {'world':>5}  {'gloo':40} {'redsock':40} {'redsock, gloo-gated tests':40} not passing where gloo passes")
    for world, gloo, redsock, gated, ours, torchs in summary:
        print(f"  {world:>5}  {_counts(gloo):40} {_counts(redsock):40} {_counts(gated):40} "
              f"{len(ours)} redsock's, {len(torchs)} torch's")
    return 1 if any(s[4] for s in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
