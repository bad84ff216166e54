"""reproduce's markdown, rendered from the stored raw results in docs/results/, byte for byte.

The golden file was written by the code before reproduce became a package (issue 41); a change
to it must be a deliberate one (regenerate with REDSOCK_WRITE_GOLDEN=1 and say why in the commit).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from redsock import reproduce as R

ROOT = Path(__file__).resolve().parents[1]
STORED = Path("docs") / "results"  # relative, as `make reproduce` names it: the commands it prints show it
GOLDEN = Path(__file__).with_name("golden") / "results.md"


def rendered() -> str:
    settings = R.PLANS["full"]
    results = []
    for step in R.make_plan(settings, STORED, "rsgolden"):
        path = STORED / step.json_name
        if not path.exists():
            results.append(R.StepResult(step, "not run"))
            continue
        cpu = R.CPU_SHARE_RE.findall((STORED / f"{step.key}.log").read_text(errors="replace"))
        results.append(R.StepResult(step, "ok", 0, 1.0, data=R.load_data(step, path),
                                    cpu_pct=max(map(int, cpu)) if cpu else None))
    info = R.RunInfo(settings, {"CPU": "golden CPU", "cores": "2"},
                     datetime(2026, 12, 2, 9, 4, tzinfo=timezone.utc), 1230.0, "/usr/bin/python3", "rsgolden",
                     figures={"transport": "transport.png", "allreduce": "allreduce.png", "latency": "latency.png",
                              "ddp": "ddp.png", "multirank": "allreduce-multirank.png"})
    return R.render_markdown(info, results, STORED)


def test_markdown_from_the_stored_results_is_unchanged(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # wherever the clone is
    md = rendered()
    if os.environ.get("REDSOCK_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(md)
    assert md == GOLDEN.read_text()
