"""The runtimes that train a graph, behind one `popbert.runtime.protocol.Session` protocol.

``torch`` is `popbert.runtime.session.TrainingSession` (the graph lowered to ``torch.fx``);
``popart`` hands the same graph to Graphcore's PopART on IPUs (`popbert.backends.popart`), which
needs the Poplar SDK that no package index carries. `make_session` (`popbert.backends.sessions`)
is the one place that chooses; the design note is in docs/design.md ("Backends").

Nothing heavy is imported here: ``popart`` is imported by `import_popart` only, the one place
that says, in one line, that the Poplar SDK is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from popbert.config.sections import BACKENDS
from popbert.errors import PopbertError, one_line

__all__ = ["BACKENDS", "SDK_MISSING", "BackendUnavailable", "import_popart", "popart_available"]

# The message of a missing SDK, kept in one place (the CLI prints it as one line).
SDK_MISSING = ("the PopART backend needs Graphcore's Poplar SDK (the `popart` Python module), "
               "which is not importable here ({reason}): install the Poplar SDK and source its "
               "enable.sh (the PyPI packages named popart/poplar are unrelated projects), or use "
               "the torch backend")


class BackendUnavailable(PopbertError, ImportError):
    """A backend that cannot run here: its SDK is not importable, or its devices are not there.

    A :class:`~popbert.errors.PopbertError`, so the CLI prints one line and exits with status 2;
    an ``ImportError`` too, so code that probes optional backends can catch the usual type.
    """


def import_popart() -> ModuleType:
    """Graphcore's ``popart`` module, or :class:`BackendUnavailable` saying the SDK is missing.

    A module named ``popart`` without ``popart.TrainingSession`` and ``popart.SessionOptions`` is
    some other project (PyPI has one) and counts as missing.
    """
    try:
        module = importlib.import_module("popart")
    except ImportError as error:  # includes a popart whose native libraries fail to load
        reason = one_line(error)
        raise BackendUnavailable(SDK_MISSING.format(reason=reason)) from None
    if not all(hasattr(module, name) for name in ("TrainingSession", "SessionOptions")):
        where = getattr(module, "__file__", None) or "?"
        raise BackendUnavailable(SDK_MISSING.format(
            reason=f"the module named popart at {where} is not Graphcore's PopART"))
    return module


def popart_available() -> bool:
    """Whether :func:`import_popart` would succeed."""
    try:
        import_popart()
    except BackendUnavailable:
        return False
    return True

