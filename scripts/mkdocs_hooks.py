"""MkDocs hook: the measured results in `benchmarks/` become pages of the site.

`benchmarks/RESULTS*.md` and `benchmarks/figures/` stay where the benchmark scripts write them;
the docs link to them as `../benchmarks/...` (a path that works on GitHub too). This hook adds
those files to the site under `benchmarks/`, so that strict mode resolves the links instead of
reporting them as missing.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

INCLUDE = ("benchmarks/*.md", "benchmarks/figures/*.png")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    docs_dir = Path(config.docs_dir)
    root = docs_dir.parent
    for pattern in INCLUDE:
        for path in sorted(root.glob(pattern)):
            rel = PurePosixPath(path.relative_to(root).as_posix())
            if rel.suffix == ".md":
                dest = rel.with_suffix("") / "index.html" if config.use_directory_urls \
                    else rel.with_suffix(".html")
            else:
                dest = rel
            # INCLUDED: a path starting with ".." would otherwise match the default exclusion
            # of dot files.
            files.append(File(f"../{rel}", str(docs_dir), config.site_dir,
                              config.use_directory_urls, dest_uri=str(dest),
                              inclusion=InclusionLevel.INCLUDED))
    return files
