"""Running the steps: each benchmark as its own process with a deadline, progress, clean-up."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..bench.procs import CPU_SHARE_RE, stop_processes
from ..bench.suite import Settings, Step, StepResult, load_data, make_plan
from ..errors import ConfigError, RedsockError
from ..testbed.launch import no_interrupts, tail, terminate_as_interrupt
from .figures import write_figures
from .render import RESULTS, RunInfo, render_markdown

#: Kinds of file this command writes under ``<out>/results/`` (cleared at the start of a run).
_OWN_SUFFIXES = (".jsonl", ".png", ".log", ".err")


def machine_info() -> dict[str, str]:
    """What the figures depend on: CPU, cores, memory, kernel, versions, the source revision."""
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or "?"
    mem = "?"
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
        kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        cc = "?"
    from .. import __version__

    return {
        "CPU": cpu, "cores": str(os.cpu_count()), "memory": mem,
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(), "torch": version("torch"), "numpy": version("numpy"),
        "redsock": f"{__version__} ({_git_revision()})",
        "TCP congestion control (default)": cc,
    }


def _git_revision() -> str:
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return "not a git checkout"
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "git unavailable"
    return f"git {head or '?'}{' + uncommitted changes' if dirty else ''}"


# ----------------------------------------------------------------------------- running

def _child_env(extra: dict[str, str]) -> dict[str, str]:
    # REDSOCK_ALGO / REDSOCK_SERVERS would change what a series means; the testbed sets servers itself.
    env = {k: v for k, v in os.environ.items() if k not in ("REDSOCK_ALGO", "REDSOCK_SERVERS")}
    env.update(extra)
    src = str(Path(__file__).resolve().parents[2])  # .../src: an uninstalled tree works too
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_step(step: Step, results_dir: Path, python: str = sys.executable) -> StepResult:
    """Run one step to completion or its deadline; never raises for the benchmark's own failures."""
    log, err = results_dir / f"{step.key}.log", results_dir / f"{step.key}.err"
    json_path = results_dir / step.json_name
    json_path.unlink(missing_ok=True)
    env = _child_env(step.env)
    t0 = time.monotonic()
    status, why = "ok", ""
    with log.open("w") as out, err.open("w") as errf:
        proc = subprocess.Popen([python, "-m", "redsock", *step.argv], stdout=out, stderr=errf, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            status, why = "timeout", f"still running after {step.timeout_s:.0f} s: stopped\n"
        except KeyboardInterrupt:
            status, why = "interrupted", "interrupted\n"
        finally:
            stop_processes([proc], grace_s=30.0)  # SIGTERM: the benchmarks tear their testbed down
    wall = time.monotonic() - t0
    rc = proc.returncode
    result = StepResult(step, status, rc, wall)
    m = CPU_SHARE_RE.findall(log.read_text(errors="replace"))
    result.cpu_pct = max(map(int, m)) if m else None
    if json_path.exists() and json_path.stat().st_size:
        try:
            result.data = load_data(step, json_path)
        except (ConfigError, OSError) as e:
            status = "failed" if status == "ok" else status
            why += f"results unreadable: {e}\n"
    if status == "ok" and rc != 0:
        status = "failed"
    if status == "ok" and not result.data:
        status, why = "failed", "exit 0 but no results written\n"
    result.status = status
    if status != "ok":
        result.error = why + (tail(err) or tail(log) or "(no output)")
    if not tail(err):
        err.unlink(missing_ok=True)
    if status == "interrupted":
        raise _Interrupted(result)
    return result


class _Interrupted(Exception):
    def __init__(self, result: StepResult):
        super().__init__("interrupted")
        self.result = result


def _clear_results(results_dir: Path) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    for p in results_dir.iterdir():
        if p.is_file() and p.suffix in _OWN_SUFFIXES:
            p.unlink()


class _Progress:
    """A rich progress bar over the steps (plain lines without a terminal or rich)."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        self.total = total
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    SpinnerColumn,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                    MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True))
                self.bar.start()
                self.task = self.bar.add_task("reproduce", total=total)
            except ImportError:
                self.bar = None

    def start(self, i: int, step: Step) -> None:
        text = f"[{i + 1}/{self.total}] {step.title}"
        if self.bar is not None:
            self.bar.update(self.task, description=text)
        else:
            print(f"# {text} ...", file=sys.stderr, flush=True)

    def done(self, r: StepResult) -> None:
        line = f"# {r.step.key}: {r.status} ({r.wall_s:.0f} s)"
        if self.bar is not None:
            self.bar.console.print(line)
            self.bar.advance(self.task)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _cleanup(prefix: str) -> list[str]:
    from ..testbed.cluster import cleanup_prefix, list_prefix_netns

    try:
        return cleanup_prefix(prefix) if list_prefix_netns(prefix) else []
    except RedsockError:
        return []


def execute(settings: Settings, out_dir: Path, prefix: str, progress: bool = True) -> tuple[int, Path]:
    """Run every step, write the report; returns (exit status, path of results.md)."""
    results_dir = out_dir / RESULTS
    _clear_results(results_dir)
    steps = make_plan(settings, results_dir, prefix)
    info = RunInfo(settings, machine_info(), datetime.now(timezone.utc), 0.0, sys.executable, prefix,
                   env={k: v for k, v in os.environ.items() if k.startswith("REDSOCK_")})
    results: list[StepResult] = []
    t0 = time.monotonic()
    bar = _Progress(progress, len(steps))
    interrupted = False
    with terminate_as_interrupt():  # SIGTERM too: stop the running step, keep what was measured
        try:
            for i, step in enumerate(steps):
                bar.start(i, step)
                try:
                    r = run_step(step, results_dir)
                except _Interrupted as e:
                    r, interrupted = e.result, True
                results.append(r)
                info.leftovers += _cleanup(prefix)  # a step that crashed may leave its testbed
                bar.done(r)
                if interrupted:
                    break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
            with no_interrupts():  # a second Ctrl-C must not leave namespaces behind
                info.leftovers += _cleanup(prefix)
    results += [StepResult(s, "not run") for s in steps[len(results):]]
    info.wall_s = time.monotonic() - t0
    write_figures(info, results, results_dir)
    path = out_dir / "results.md"
    path.write_text(render_markdown(info, results, results_dir))
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"redsock reproduce: {r.step.key}: {r.status}", file=sys.stderr)
    print(f"wrote {path} ({len(results) - len(bad)}/{len(results)} steps ok, {info.wall_s / 60:.1f} min)")
    return (130 if interrupted else 1 if bad else 0), path
