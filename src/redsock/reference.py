"""The docs' reference pages, generated from the code so they cannot drift.

- :func:`environment_markdown`: every ``REDSOCK_*`` variable from :class:`~redsock.config.Config`
  (the ``#:`` comment above a field is its effect; the field's validator says its allowed values)
  and :data:`~redsock.config.OTHER_VARIABLES`;
- :func:`cli_markdown`: every ``redsock`` command and flag, walked from the argparse parser;
- :func:`headline_markdown`: the README's headline figures, picked from ``docs/results.md``.

``python -m redsock.reference {environment,cli,headline}`` prints one of them;
``python -m redsock.reference readme`` rewrites the README's headline table in place
(``--check``: exit 1 when it is stale).  The docs build runs them through ``docs/hooks/reference.py``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import config as config_module
from .config import OTHER_VARIABLES, Config, env_var
from .errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]  # the repository (src layout)


# --- environment variables ---------------------------------------------------------------

@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    values: str
    effect: str
    field: str | None  #: the Config field (keyword of redsock.init / Config.from_env), if any


def field_docs() -> dict[str, str]:
    """Config field -> its ``#:`` comment (the Sphinx convention the source already follows)."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Config")
    docs: dict[str, str] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comment: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                comment.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            docs[node.target.id] = _rst_to_md(" ".join(comment))
    return docs


def variables() -> list[Variable]:
    """Every variable redsock reads: one per Config field, then the others."""
    docs = field_docs()
    out = []
    for f in dataclasses.fields(Config):
        if not docs.get(f.name):
            raise ConfigError(f"Config.{f.name} has no '#:' comment: the reference needs its effect")
        out.append(Variable(env_var(f.name), _format_default(f), _allowed_values(f), docs[f.name], f.name))
    out += [Variable(name, "unset", "", _rst_to_md(text), None) for name, text in OTHER_VARIABLES.items()]
    return out


def _format_default(f: dataclasses.Field[Any]) -> str:
    factory: Any = f.default_factory  # (MISSING where the field has a plain default)
    value = f.default if f.default is not dataclasses.MISSING else factory()
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return format_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def format_size(n: int) -> str:
    """4 -> "4", 32768 -> "32K", 64 GiB -> "64G": as REDSOCK_* sizes are written."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


_PROBES = {"int": -1, "float": -1.0, "str": "\0"}


def _allowed_values(f: dataclasses.Field) -> str:
    """What the validator accepts, in its own words: Config's check of an out-of-range value
    says "<field> must be <allowed>, got ...", so the reference quotes the check itself."""
    typ = str(f.type)
    base = next((k for k in ("bool", "tuple", "float", "int", "bytes", "str") if k in typ), "str")
    kinds = {"bool": "0/1 (also true/false, yes/no, on/off)", "tuple": "comma-separated HOST:PORT list",
             "float": "number", "int": "integer; sizes take K, M, G (binary)", "bytes": "string",
             "str": "string"}
    probe = _PROBES.get(base)
    if probe is not None:
        try:
            probe_args: dict[str, Any] = {f.name: probe}
            Config(**probe_args)
        except ConfigError as e:
            m = re.search(r"must be (.*?)(?:, got .*)?$", str(e))
            if m and m.group(1).startswith("one of ("):  # "one of ('dynamic', 'static')"
                return ", ".join(f"`{v}`" for v in ast.literal_eval(m.group(1)[len("one of "):]))
            if m:
                return f"{m.group(1)} ({kinds[base].split(';')[0]})"
        except TypeError:  # a probe of the wrong kind for this check
            pass
    return kinds[base]


def environment_markdown() -> str:
    rows = ["| variable | default | values | effect |", "|---|---|---|---|"]
    for v in variables():
        keyword = f" Keyword: `{v.field}=`." if v.field else ""
        rows.append(f"| `{v.name}` | `{v.default}` | {_cell(v.values) or '—'} | {_cell(v.effect)}{keyword} |")
    return "\n".join(rows) + "\n"


# --- commands ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  #: ("bench", "allreduce"): `redsock bench allreduce`
    help: str
    parser: argparse.ArgumentParser


def commands(parser: argparse.ArgumentParser | None = None) -> list[Command]:
    """Every command, depth first, walked from the parser redsock itself runs (argparse keeps
    sub-commands and their help in private attributes; there is no public walk)."""
    if parser is None:
        from .cli import build_parser

        parser = build_parser()
    out: list[Command] = []

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...], help_text: str) -> None:
        out.append(Command(path, help_text, p))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help or "" for a in action._choices_actions}
                for name, sub in action.choices.items():
                    walk(sub, path + (name,), helps.get(name, ""))

    walk(parser, (), parser.description or "")
    return out


def cli_markdown() -> str:
    parts = []
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps usage at the terminal's width: fix it
    try:
        for cmd in commands():
            title = " ".join(("redsock",) + cmd.path)
            parts.append(f"## `{title}`\n")
            if cmd.help:
                parts.append(_rst_to_md(cmd.help.strip()) + "\n")
            parts.append("```text\n" + cmd.parser.format_usage().strip() + "\n```\n")
            rows = _option_rows(cmd.parser)
            if rows:
                parts.append("| option | default | effect |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flags = ", ".join(a.option_strings) or a.dest
        if a.option_strings and a.nargs != 0:
            flags += " " + (a.metavar if isinstance(a.metavar, str) else a.dest.upper())
        default = a.default
        hidden = default is None or default is False or default == "" or default == argparse.SUPPRESS
        shown = "" if hidden else f"`{default}`"
        text = formatter._expand_help(a) if a.help else ""
        if a.choices and not isinstance(a.choices, dict):
            text += ("; " if text else "") + "one of " + ", ".join(f"`{c}`" for c in a.choices)
        rows.append(f"| `{flags}` | {shown} | {_cell(text)} |")
    return rows


# --- headline figures --------------------------------------------------------------------

#: Rows of docs/results.md's summary that the README shows (prefixes of the claim column).
HEADLINE_CLAIMS = (
    "Fast Socket: 60%+ more bandwidth",
    "Reducers vs gloo algbw (N=4, 64 MiB)",
    "redsock auto, reducers set: hierarchical",
    "DDP training speed-up, reducers vs gloo (N=4)",
    "8 B all-reduce latency vs N, redsock reducers",
    "8 B all-reduce latency vs N, gloo",
)
README_BEGIN = "<!-- headline figures: generated from docs/results.md by `python -m redsock.reference readme`; do not edit -->"
README_END = "<!-- end of headline figures -->"


def headline_markdown(results: Path | None = None) -> str:
    """The README's table: chosen rows of the summary ``redsock reproduce`` wrote, and when."""
    text = (results or ROOT / "docs" / "results.md").read_text()
    when = re.search(r"on (\d{4}-\d{2}-\d{2})", text)
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in summary.splitlines() if r.startswith("| ") and not r.startswith("| claim")]
    picked = []
    for claim in HEADLINE_CLAIMS:
        match = [r for r in rows if r[2:].startswith(claim)]
        if len(match) != 1:
            raise ConfigError(f"docs/results.md's summary has {len(match)} rows for {claim!r}")
        picked.append(match[0])
    head = "| claim | measured | bound / ideal |\n|:---|:---|:---|"
    date = f" ({when.group(1)})" if when else ""
    return (f"{head}\n" + "\n".join(picked) + f"\n\nFrom [docs/results.md](docs/results.md){date}, written by "
            "`sudo make reproduce` on a 2-core VM (hosts are network namespaces, links shaped by tc; the "
            "results say each section's link rate); every ratio against gloo measured in the same run.\n")


def update_readme(readme: Path | None = None, check: bool = False) -> bool:
    """Put :func:`headline_markdown` between the README's markers; True when it changed."""
    readme = readme or ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    new = text[:start] + "\n" + headline_markdown() + text[end:]
    if new != text and not check:
        readme.write_text(new)
    return new != text


# --- helpers -----------------------------------------------------------------------------

def _rst_to_md(text: str) -> str:
    """``x`` and :func:`x` (reStructuredText, as docstrings here write them) -> `x`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redsock.reference", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("environment", "cli", "headline", "readme"))
    p.add_argument("--check", action="store_true", help="readme: exit 1 if the table is stale, change nothing")
    args = p.parse_args(argv)
    if args.what == "readme":
        return int(update_readme(check=args.check) and args.check)
    print({"environment": environment_markdown, "cli": cli_markdown, "headline": headline_markdown}[args.what]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
