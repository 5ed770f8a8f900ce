"""A Dask worker preload for tests (`dask worker --preload tests/hide_popbert.py`): on that
worker `import popbert` fails as it does where popbert is not installed (ModuleNotFoundError),
while Dask itself runs as usual, the way a worker started from another environment does."""

from __future__ import annotations

import sys


class _NotInstalled:
    """A finder consulted before all others that knows no popbert module."""

    def find_spec(self, name, path=None, target=None):
        if name == "popbert" or name.startswith("popbert."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for _name in [m for m in sys.modules if m == "popbert" or m.startswith("popbert.")]:
    del sys.modules[_name]
sys.meta_path.insert(0, _NotInstalled())
