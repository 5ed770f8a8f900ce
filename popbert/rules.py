"""What a setting may hold, declared once on its dataclass field.

A field made with :func:`setting` carries its :class:`Rule` (a range, a set of names); the
owner's ``validate`` runs :func:`check_fields`, and anything else that takes the same value
(``SessionOptions``) looks the rule up with :func:`rule_of` instead of restating it. A failure is
an :class:`Invalid` carrying the keys it involves, so the config loader can blame the file or the
``--set`` override that gave them without reading the message.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from popbert.errors import ConfigError

# How a broken rule reads: "key must be >= 1, got 0", or as the loader words a wrong type
# ("key: expected one of torch, popart, got 'jax'"), which a config's choices follow.
MUST_BE = "{key} must be {expected}, got {value}"
EXPECTED = "{key}: expected {expected}, got {value}"


class Invalid(ConfigError):
    """A setting that breaks its rule; ``keys``: the dotted keys involved, most to blame first."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True)
class Rule:
    """A test of one value and the words for what it expects ("> 0", "one of cpu, cuda")."""

    test: Callable[[Any], bool]
    expected: str
    nullable: bool = False  # None passes (and the words say "or null")
    form: str = MUST_BE

    def allows(self, value: Any) -> bool:
        return self.nullable if value is None else bool(self.test(value))

    def message(self, key: str, value: Any, form: str | None = None) -> str:
        expected = f"{self.expected} or null" if self.nullable else self.expected
        shown = repr(value) if isinstance(value, str) else value
        return (form or self.form).format(key=key, expected=expected, value=shown)

    def check(self, key: str, value: Any) -> None:
        """Raise :class:`Invalid` naming ``key`` when ``value`` breaks the rule."""
        if not self.allows(value):
            raise Invalid(self.message(key, value), key)

    def or_null(self) -> Rule:
        return dataclasses.replace(self, nullable=True)


def at_least(bound: float, note: str = "") -> Rule:
    return Rule(lambda v: v >= bound, f">= {bound}{note}")


def above(bound: float) -> Rule:
    return Rule(lambda v: v > bound, f"> {bound}")


def within(interval: str, note: str = "") -> Rule:
    """A value in an interval written as in maths: "[0, 1)", "(0, 1]"."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    low_ok = (lambda v: v >= low) if interval[0] == "[" else (lambda v: v > low)
    high_ok = (lambda v: v <= high) if interval[-1] == "]" else (lambda v: v < high)
    return Rule(lambda v: low_ok(v) and high_ok(v), f"in {interval}{note}")


def one_of(names: Iterable[str], form: str = MUST_BE) -> Rule:
    names = tuple(names)
    return Rule(lambda v: v in names, f"one of {', '.join(names)}", form=form)


POSITIVE_INT = Rule(lambda v: v > 0, "a positive integer")
#: Threads a runtime (torch, ONNX Runtime, OpenVINO) is given, or processes a command starts on
#: one machine (`serve --workers`): a count past any machine's cores is a typo, and every one of
#: them would be started.
MAX_PER_MACHINE = 1024
PER_MACHINE = Rule(lambda v: 1 <= v <= MAX_PER_MACHINE, f"from 1 to {MAX_PER_MACHINE}")
#: The largest integer a setting may hold: what a C `int` holds (torch's thread count, the
#: sizes of tensors' dimensions through NumPy and ONNX), so a typo of a few extra digits is one
#: line in the config loader, not an overflow deep inside a library.
INT_LIMIT = 2**31 - 1
#: A random seed: what NumPy, torch and Python's `random` all take.
SEED = Rule(lambda v: 0 <= v <= INT_LIMIT, f"from 0 to {INT_LIMIT} (2**31 - 1)")
#: Where an export runs (`serve`, `predict`, `evaluate`): the CPU's runtimes (ONNX Runtime,
#: OpenVINO), or a GPU through popbert's torch backend.
EXPORT_DEVICE = Rule(lambda v: re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None,
                     "cpu, cuda or cuda:N")


def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None, *,
            factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its rule: ``lr: float = setting(0.001, above(0))``."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"rule": rule} if rule is not None else {})


def rule_of(cls: Any, name: str) -> Rule | None:
    """The rule on field ``name`` of dataclass ``cls`` (None: the field has none)."""
    return next((f.metadata.get("rule") for f in dataclasses.fields(cls) if f.name == name), None)


def check_fields(obj: Any, prefix: str) -> None:
    """Check every field of ``obj`` that has a rule, in field order; keys are ``prefix.name``."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        if rule is not None:
            rule.check(f"{prefix}.{f.name}", getattr(obj, f.name))


__all__ = ["EXPECTED", "EXPORT_DEVICE", "INT_LIMIT", "MAX_PER_MACHINE", "MUST_BE", "PER_MACHINE",
           "POSITIVE_INT", "SEED", "Invalid", "Rule", "above", "at_least", "check_fields",
           "one_of", "rule_of", "setting", "within"]
