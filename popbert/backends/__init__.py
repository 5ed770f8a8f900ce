"""The runtimes behind a :class:`~popbert.runtime.session.TrainingSession`: torch and popart.

``torch`` is the session itself (the graph lowered to ``torch.fx``, ``popbert.runtime``).
``popart`` hands the same graph to Graphcore's PopART on IPUs
(:mod:`popbert.backends.popart`); it needs the Poplar SDK, which no package index carries.

How a session picks its backend, and why this way
--------------------------------------------------

The choice is made once, when the session is made: ``TrainingSession.__new__`` looks at
``backend=`` (or ``SessionOptions.backend``) and, for ``"popart"``, returns a
:class:`~popbert.backends.popart.PopartTrainingSession` built from the same arguments instead of
a torch session (a factory, so ``TrainingSession(...)`` stays the one way to make a session).
After that nothing is chosen again: the torch session has no ``if backend`` anywhere in its
step, and the PopART session is a class of its own with the same public face (``run(batch)`` →
per-step outputs, ``step``, ``weights()``, ``load_weights()``, ``state_dict()`` /
``load_state_dict()``, ``replicas``, ``loss_name``, ``loss_scaler``, ``optimizer``), which is all
:func:`popbert.train.loop.train_loop` and the pre-training job use.

The alternatives were worse: a backend object inside ``TrainingSession`` would route every method
of the torch path through one more indirection (or an ``if``) for a backend most installs cannot
load; a subclass of ``TrainingSession`` would inherit the lowering it must not run, and would make
``popbert.backends`` import ``popbert.runtime`` while ``popbert.runtime`` imports
``popbert.backends`` (a cycle between the layers, ``tests/test_architecture.py``). So the
dependency points one way, runtime → backends: the session hands the backend the one piece of the
runtime it shares (the batch checker, ``popbert.runtime.inputs.InputChecker``) as an argument.

Nothing heavy is imported here: ``popart`` is imported by :func:`import_popart` only, the one
place that says, in one line, that the Poplar SDK is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from popbert.errors import PopbertError

__all__ = ["BACKENDS", "SDK_MISSING", "BackendUnavailable", "import_popart", "popart_available"]

BACKENDS = ("torch", "popart")

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
        reason = " ".join(str(error).split()) or type(error).__name__
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

