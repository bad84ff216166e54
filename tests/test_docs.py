"""The documentation: README and docs/ build strictly, their examples run, the reference is complete.

Every ```python and ```bash block of README.md and docs/**.md runs here, unless the line before it
is a marker saying why not:

    <!-- docs-test: skip (REASON) -->          not run here (needs root, a cluster, minutes...)
    <!-- docs-test: same-as-readme -->         the same text as a README quick start block (run there)
    <!-- docs-test: torchrun N -->             a python block run as a script under torchrun, N ranks
    <!-- docs-test: skip-page (REASON) -->     anywhere in a page: none of its blocks (the lab log)
"""

from __future__ import annotations

import ast
import html
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from redsock import config, reference
from redsock.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README] + sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)
BIN = Path(sys.executable).parent
MARKER = re.compile(r"^<!-- docs-test: (skip-page|same-as-readme|torchrun|skip)\s*(.*?)\s*-->$")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: tuple[str, str] | None  # (kind, argument)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w+)", lines[i])
        if m:
            start, i = i, i + 1
            while not lines[i].startswith("```"):
                i += 1
            before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
            mark = MARKER.match(before)
            out.append(Block(page, start + 1, m.group(1), "\n".join(lines[start + 1:i]) + "\n",
                             mark.groups() if mark else None))
        i += 1
    return out


def quick_start_blocks() -> list[Block]:
    """The README's quick start section, in order."""
    text = README.read_text()
    start = text.index("\n## Quick start\n")
    end = text.index("\n## ", start + 1)
    first, last = text[:start].count("\n") + 1, text[:end].count("\n") + 1
    return [b for b in blocks(README) if first <= b.line <= last and b.lang in ("bash", "python")]


def run(block: Block, timeout: float = 150) -> subprocess.CompletedProcess:
    """Run a block as its reader would, from the repository root with .venv/bin on the PATH, in a
    session of its own: whatever it leaves running (a `redsock serve &`) is killed afterwards."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if block.lang == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    else:
        script = Path(os.environ.get("TMPDIR", "/tmp")) / f"redsock-docs-{os.getpid()}-{block.line}.py"
        script.write_text(block.code)
        argv = [str(BIN / "python"), str(script)]
        if block.marker and block.marker[0] == "torchrun":
            argv = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", block.marker[1], str(script)]
    # Output to a file, not a pipe: a server the block left running would hold a pipe open.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            if block.lang == "python":
                script.unlink(missing_ok=True)
        log.seek(0)
        out = log.read()
    if proc.returncode == -signal.SIGKILL:
        pytest.fail(f"{block.id} did not finish in {timeout:g} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out)


# --- the README ---------------------------------------------------------------------------

def test_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150
    head = "\n".join(lines[:40])
    assert "make demo" in head and "make test" in head


def test_readme_headline_figures_are_generated_from_the_results():
    assert not reference.update_readme(check=True), "stale: run python -m redsock.reference readme"


def test_quick_start_literally():
    """The README's three quick starts, as written: numpy on 4 local ranks, torchrun DDP with
    --backend redsock, 2 workers through a `redsock serve`; each one's result checked."""
    numpy_run, snippet, ddp, reducers = quick_start_blocks()

    out = run(numpy_run)
    assert out.returncode == 0, out.stdout
    assert "on 4 ranks: every element 10, bitwise equal on every rank" in out.stdout

    assert snippet.marker == ("torchrun", "2")
    out = run(snippet)
    assert out.returncode == 0, out.stdout

    def losses(text: str) -> tuple[float, float]:
        first = float(re.search(r"step +0 +loss (\S+)", text).group(1))
        result = re.search(r"RESULT backend=redsock .* world=(\d+) .* final_loss=(\S+)", text)
        return first, float(result.group(2))

    out = run(ddp)
    assert out.returncode == 0, out.stdout
    assert "world=4" in out.stdout
    first, final = losses(out.stdout)
    assert final < first  # it trained

    out = run(reducers)
    assert out.returncode == 0, out.stdout
    first, final = losses(out.stdout)
    assert final < first
    rounds = re.search(r"^redsock_server_rounds_total (\S+)$", out.stdout, re.M)
    assert rounds and float(rounds.group(1)) >= 10, out.stdout  # every step's buckets went through it


# --- every example ------------------------------------------------------------------------

# Written by `redsock reproduce`, which cannot carry markers: its commands are the record of what that
# run did (root, network namespaces, minutes each).
GENERATED = {DOCS / "results.md"}


def _examples() -> list[Block]:
    quick = {b.id for b in quick_start_blocks()}
    out = []
    for page in PAGES:
        if page in GENERATED:
            continue
        if any((m := MARKER.match(ln.strip())) and m.group(1) == "skip-page" for ln in page.read_text().splitlines()):
            continue
        out += [b for b in blocks(page) if b.lang in ("bash", "python") and b.id not in quick]
    return out


EXAMPLES = _examples()


def test_markers_are_justified():
    for page in PAGES:
        for ln in page.read_text().splitlines():
            m = MARKER.match(ln.strip())
            if m and m.group(1) in ("skip", "skip-page"):
                assert re.fullmatch(r"\(.{12,}\)", m.group(2)), f"{page}: a skip needs its reason: {ln}"
    readme = {b.code for b in quick_start_blocks()}
    for b in EXAMPLES:
        if b.marker and b.marker[0] == "same-as-readme":
            assert b.code in readme, f"{b.id} is marked same-as-readme but differs from the README's"


@pytest.mark.parametrize("block", [b for b in EXAMPLES if not b.marker or b.marker[0] == "torchrun"],
                         ids=lambda b: b.id)
def test_example_runs(block):
    out = run(block)
    assert out.returncode == 0, f"{block.id}:\n{block.code}\n{out.stdout[-4000:]}"


# --- the site -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode == 0, proc.stderr
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def documented_variables() -> set[str]:
    """Every REDSOCK_* name src/ mentions (code, strings, comments), less Python identifiers
    (``REDSOCK_ALGOS = (...)`` is a constant, not a variable)."""
    names, identifiers = set(), set()
    for path in (ROOT / "src" / "redsock").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"\bREDSOCK_[A-Z0-9_]*[A-Z0-9]\b", text))
        identifiers |= {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)}
    return names - identifiers


def test_reference_lists_every_variable(site):
    page = _text(site / "reference" / "environment" / "index.html")
    fields = {config.env_var(f) for f in config.Config.__dataclass_fields__}
    wanted = documented_variables() | fields
    assert "REDSOCK_TIMEOUT_S" in wanted and "REDSOCK_ALGOS" not in wanted
    # a row per variable: its name, then its default
    missing = sorted(v for v in wanted if not re.search(rf"^{v}\s*$", page, re.M))
    assert not missing, f"not in the reference (document them in config.py): {missing}"
    for v in reference.variables():
        assert v.effect and v.default, v


def test_reference_lists_every_command_and_flag(site):
    page = (site / "reference" / "cli" / "index.html").read_text()
    sections = re.split(r"<h2 ", page)

    def walk(parser, path):
        yield path, parser
        for action in parser._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + [name])

    seen = 0
    for path, parser in walk(build_parser(), ["redsock"]):
        title = " ".join(path)
        section = next((s for s in sections if re.match(rf'id="[^"]*"><code>{re.escape(title)}</code>', s)), None)
        assert section is not None, f"`{title}` is missing from the command reference"
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert html.escape(flag) in section, f"`{title} {flag}` is missing from the reference"
        seen += 1
    assert seen >= 15


def test_troubleshooting_quotes_real_messages():
    """Each heading quotes a part of a message the code raises ("…" for variable parts)."""
    page = (DOCS / "guides" / "troubleshooting.md").read_text()
    source = "".join(p.read_text() for p in (ROOT / "src" / "redsock").rglob("*.py"))
    headings = re.findall(r"^### `(.*)`$", page, re.M)
    assert len(headings) >= 40
    for h in headings:
        for part in filter(str.strip, h.split("…")):
            assert part in source, f"troubleshooting quotes {h!r}, which src/ does not raise"
    from redsock import errors
    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == errors.__name__:
            assert f"`{name}`" in page, f"troubleshooting does not explain {name}"


def test_internal_links(site):
    """Every relative link of README and docs/ names a file that exists (and mkdocs --strict
    checks the docs' anchors)."""
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
    assert (site / "guides" / "troubleshooting" / "index.html").exists()
