"""redsock calibrate's parts (the full run takes minutes of benchmarks: `redsock calibrate`):
the memory rates, the reducer it starts and reads the CPU time of, the benchmark wrapper's errors."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from redsock.cli import main
from redsock.errors import RedsockError
from redsock.plan import calibrate


def test_memory_rates_are_plausible() -> None:
    reduce_Bps, copy_Bps = calibrate.memory_rates(nbytes=1 << 20, reps=3)
    assert 1e8 < reduce_Bps < 1e12 and 1e8 < copy_Bps < 1e12


def test_reducer_starts_serves_and_stops_on_sigterm() -> None:
    with calibrate._Reducer() as r:  # noqa: SLF001
        host, port = r.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with socket.create_connection((host, int(port)), timeout=10):
            pass  # it listens
        busy = np.ones(1 << 16)  # the reducer's CPU clock is readable and never negative
        assert r.cpu_s() >= 0.0 and busy.sum() > 0
        proc = r.proc
    assert proc.returncode == 0  # SIGTERM: a clean stop


def test_bench_failure_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RedsockError, match="failed"):
        calibrate._bench(["floor", "--mode", "nonsense"],  # noqa: SLF001
                         tmp_path / "x.jsonl", 120)
    with pytest.raises(RedsockError, match="no gloo row"):
        calibrate._median_s([{"algo": "small", "bytes": 8, "median_s": 1e-4}], "gloo", 8)  # noqa: SLF001


@pytest.mark.parametrize("argv", [["--goodput", "1.5"], ["--timeout", "0"]])
def test_calibrate_refuses_bad_options(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", *argv]) == 2
    assert "redsock: error" in capsys.readouterr().err


def test_a_calibrated_profile_is_what_plan_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file calibrate writes (profile fields + the raw figures under "measured")."""
    from redsock.plan.profile import DEFAULT

    path = tmp_path / "p.json"
    path.write_text(json.dumps({**DEFAULT.to_json(), "redsock_step_s": 1e-5, "source": "here",
                                "measured": {"small_8B_s": 1e-5}}))
    assert main(["plan", "--hosts", "4", "--link", "1gbit", "--profile", str(path), "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"]["redsock_step_s"] == 1e-5 and out["profile"]["source"] == "here"


def test_calibrate_quick_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real thing, short: its benchmarks run, the profile is plausible and plan reads it."""
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    obj = json.loads(out.read_text())
    assert 1e-6 < obj["redsock_step_s"] < 0.1 and 1e-6 < obj["gloo_step_s"] < 0.1
    assert 1e-6 < obj["reducer_hop_s"] < 0.1
    assert 1e-12 < obj["reducer_cpu_s_per_byte"] < 1e-6  # 1 TB/s .. 1 MB/s per core
    assert obj["measured"]["reducer_bytes_in"] == 4 * 2 * calibrate.REDUCER_SWEEP_BYTES
    capsys.readouterr()
    assert main(["plan", "--hosts", "4", "--link", "1gbit", "--profile", str(out), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"]["source"].startswith("redsock calibrate on")
