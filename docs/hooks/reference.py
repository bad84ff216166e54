"""mkdocs hook: a page's ``<!-- reference: NAME -->`` line becomes the generated markdown of
``redsock.reference`` (environment, cli, headline), so the reference is rebuilt from the code on
every build and cannot drift from it."""

import re

from redsock import reference

GENERATORS = {
    "environment": reference.environment_markdown,
    "cli": reference.cli_markdown,
    "headline": reference.headline_markdown,
}


def on_page_markdown(markdown, page, config, files):
    def fill(m):
        text = GENERATORS[m.group(1)]()
        # The headline table links docs/results.md from the README; inside docs/ it is results.md.
        return text.replace("](docs/results.md)", "](" + "../" * page.file.src_uri.count("/") + "results.md)")

    return re.sub(r"^<!-- reference: (\w+) -->$", fill, markdown, flags=re.M)
