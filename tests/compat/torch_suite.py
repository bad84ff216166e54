"""Run torch's own distributed test suite on one backend and record every outcome.

    python tests/compat/torch_suite.py --backend redsock --world-size 2 [--gate gloo]
        [--only NAME ...] [--only-file FILE] [-k SUBSTRING] [--json OUT]

Set-up and gates: see ``suite.py`` beside this file.  Writes one JSON object: backend,
gate, world_size, seconds, and per test its outcome (passed / failed / skipped), the skip
reason or the error's last lines, and its seconds; prints one line per test on stderr.
The top level of this file only defines things: each rank's process runs it again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import unittest
from pathlib import Path


class _Recorder(unittest.TestResult):
    """Outcome, skip reason or error, and time of every test; one line per test on stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict] = {}
        self._started = 0.0

    def startTest(self, test):  # noqa: N802 - unittest's names
        super().startTest(test)
        self._started = time.monotonic()

    def _record(self, test, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        rec = {"outcome": outcome, "seconds": round(time.monotonic() - self._started, 2)}
        if detail:
            rec["detail"] = detail
        self.records[name] = rec
        print(f"[{outcome:7}] {name} ({rec['seconds']:.1f}s){' ' + detail.splitlines()[-1][:160] if detail else ''}",
              file=sys.stderr, flush=True)

    def addSuccess(self, test):  # noqa: N802
        super().addSuccess(test)
        self._record(test, "passed")

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self._record(test, "skipped", str(reason))

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self._record(test, "failed", _tail(self._exc_info_to_string(err, test)))

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self._record(test, "failed", _tail(self._exc_info_to_string(err, test)))

    def addExpectedFailure(self, test, err):  # noqa: N802
        super().addExpectedFailure(test, err)
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._record(test, "failed", "unexpected success")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="redsock")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--gate", choices=["gloo"], help="evaluate the suite's backend-name gates as for this backend")
    p.add_argument("--only", nargs="*", default=[], help="test names to run (default: all)")
    p.add_argument("--only-file", help="a JSON list of test names to run")
    p.add_argument("-k", dest="substring", default="", help="run tests whose name contains this")
    p.add_argument("--start-method", choices=["forkserver", "spawn"], default="forkserver",
                   help="how ranks start (spawn: as upstream, about 10 s more per test here)")
    p.add_argument("--test-timeout", type=int, default=180, help="seconds per test before it counts as failed")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    import importlib

    suite_setup = importlib.import_module("suite_env")
    suite_setup.prepare_environment(args.backend, args.world_size, gate=args.gate, start_method=args.start_method,
                                    test_timeout=args.test_timeout)
    cls = importlib.import_module("suite").TestDistBackendWithSpawn
    names = sorted(unittest.TestLoader().getTestCaseNames(cls))
    wanted = set(args.only)
    if args.only_file:
        wanted |= set(json.loads(Path(args.only_file).read_text()))
    if wanted:
        names = [n for n in names if n in wanted]
    if args.substring:
        names = [n for n in names if args.substring in n]
    tests = unittest.TestSuite(cls(n) for n in names)
    result = _Recorder()
    started = time.monotonic()
    tests.run(result)
    summary = {"backend": args.backend, "gate": args.gate, "world_size": args.world_size,
               "seconds": round(time.monotonic() - started, 1), "tests": result.records}
    counts = {k: sum(1 for r in result.records.values() if r["outcome"] == k) for k in ("passed", "failed", "skipped")}
    print(f"{args.backend}{' (gate ' + args.gate + ')' if args.gate else ''} world {args.world_size}: "
          f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"in {summary['seconds']:.0f}s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
