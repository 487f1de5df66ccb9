"""mkdocs hook: README.md is not a page of the site, so mkdocs does not check its links.
After the build, every relative link of README.md must name a file of the repository, and a
link to a page of the site with an anchor must name an anchor that page has.  A bad link is
a warning, which `mkdocs build --strict` turns into a failed build."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.readme_links")

LINK = re.compile(r"\]\(([^)\s]+)\)")


def on_post_build(config: Any, **kwargs: Any) -> None:
    root = Path(config.config_file_path).parent
    docs = Path(config.docs_dir)
    site = Path(config.site_dir)
    readme = root / "README.md"
    for url in LINK.findall(readme.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", url) or url.startswith("#"):
            continue  # a web address, or an anchor of README itself (GitHub's)
        path, _, anchor = url.partition("#")
        target = (root / path).resolve()
        if not target.exists():
            log.warning("README.md links to %s, which does not exist", url)
            continue
        if anchor and target.suffix == ".md" and target.is_relative_to(docs.resolve()):
            page = site / target.relative_to(docs.resolve()).with_suffix(".html")
            if f'id="{anchor}"' not in page.read_text(encoding="utf-8"):
                log.warning("README.md links to %s, but that page has no anchor #%s", url,
                            anchor)
