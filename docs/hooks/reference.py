"""mkdocs hooks.

- A page's ``<!-- reference: NAME -->`` line becomes the generated markdown of ``redsock.reference``
  (environment, cli, headline), so the reference is rebuilt from the code on every build and cannot
  drift from it.
- ``results/files.md``: a listing of the raw files ``redsock reproduce`` wrote beside results.md
  (which links ``results/``), so the raw JSON and logs are part of the site.
"""

import re
from pathlib import Path

from mkdocs.structure.files import File

from redsock import reference

GENERATORS = {
    "environment": reference.environment_markdown,
    "cli": reference.cli_markdown,
    "headline": reference.headline_markdown,
}


def on_files(files, config):
    results = Path(config["docs_dir"]) / "results"
    if results.is_dir():
        names = sorted(p.name for p in results.iterdir() if p.is_file())
        listing = "# Raw results\n\nWhat `redsock reproduce` wrote for [the results](../results.md): " \
                  "benchmark output (`.log`), one JSON object per row (`.jsonl`) and the plots.\n\n"
        listing += "\n".join(f"- [{name}]({name})" for name in names) + "\n"
        files.append(File.generated(config, "results/files.md", content=listing))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "results.md":  # written by `redsock reproduce`: its link to the folder
        markdown = markdown.replace("](results/)", "](results/files.md)")

    def fill(m):
        text = GENERATORS[m.group(1)]()
        # The headline table links docs/results.md from the README; inside docs/ it is results.md.
        return text.replace("](docs/results.md)", "](" + "../" * page.file.src_uri.count("/") + "results.md)")

    return re.sub(r"^<!-- reference: (\w+) -->$", fill, markdown, flags=re.M)


def on_page_content(html, page, config, files):
    # Docstrings here cross-reference the Sphinx way (:class:`Config`); markdown keeps the role's
    # name in front of the code span: drop it.
    return re.sub(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code>)", "", html)
