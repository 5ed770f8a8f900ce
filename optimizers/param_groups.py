"""Per-tensor optimizer options chosen by parameter name.

Graphcore's BERT turns weight decay off for tensors whose names end in ``Beta``, ``Bias``,
``Gamma`` or ``B`` and turns LAMB's trust ratio off (plain Adam step) for ``Beta``, ``Bias`` and
``B``; LayerNorm ``Gamma`` keeps LAMB. The default patterns below do the same for popbert's own
names (``Layer0/Attention/QKV/B``, ``Layer0/Attention/Norm/Gamma``, ``CLS/MLM/Bias``) and for
ordinary torch names (``*.bias``, ``*LayerNorm.weight``, ``*norm*.weight``, ``ln_*.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import Tensor

__all__ = ["DEFAULT_NO_DECAY", "DEFAULT_NO_TRUST", "classify_parameter", "param_groups_by_name"]

# Last name component (split on "/" or ".") is a bias / LayerNorm parameter, or the weight of a
# normalisation module (a component containing "norm", or named ln / ln_* / ln1 / bn1 ...).
DEFAULT_NO_DECAY = (
    r"(?:^|[/.])(?:Beta|Bias|Gamma|B|bias|beta|gamma)$"
    r"|(?:^|[/.])(?:[^/.]*(?i:norm)[^/.]*|ln(?:_[^/.]*|\d+)?|bn\d*)[/.]weight$"
)
# Biases and LayerNorm betas take a plain Adam step; gammas / norm weights keep the trust ratio.
DEFAULT_NO_TRUST = r"(?:^|[/.])(?:Beta|Bias|B|bias|beta)$"

PatternLike = str | re.Pattern[str] | None


def _compile(pattern: PatternLike) -> re.Pattern[str] | None:
    if pattern is None or isinstance(pattern, re.Pattern):
        return pattern
    return re.compile(pattern)


def classify_parameter(
    name: str,
    no_decay: PatternLike = DEFAULT_NO_DECAY,
    no_trust: PatternLike = DEFAULT_NO_TRUST,
) -> tuple[bool, bool]:
    """Return ``(use_weight_decay, use_trust_ratio)`` for a parameter name (``re.search``)."""
    decay_re, trust_re = _compile(no_decay), _compile(no_trust)
    decay = decay_re is None or decay_re.search(name) is None
    trust = trust_re is None or trust_re.search(name) is None
    return decay, trust


def param_groups_by_name(
    named_parameters: Iterable[tuple[str, Tensor]],
    weight_decay: float,
    no_decay: PatternLike = DEFAULT_NO_DECAY,
    no_trust: PatternLike = DEFAULT_NO_TRUST,
    **options: Any,
) -> list[dict[str, Any]]:
    """Split parameters into optimizer groups by weight decay and trust ratio.

    Returns up to four groups, in a fixed order so optimizer state dicts stay loadable, each
    with ``params``, ``names``, ``weight_decay`` (``weight_decay`` or 0.0) and ``trust_ratio``,
    plus any extra ``options`` (e.g. ``lr``). Parameters with ``requires_grad=False`` are left
    out; a pattern of ``None`` excludes nothing.
    """
    decay_re, trust_re = _compile(no_decay), _compile(no_trust)
    buckets: dict[tuple[bool, bool], dict[str, Any]] = {}
    for key in ((True, True), (False, True), (True, False), (False, False)):
        buckets[key] = {"params": [], "names": []}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        key = classify_parameter(name, decay_re, trust_re)
        buckets[key]["params"].append(param)
        buckets[key]["names"].append(name)
    groups = []
    for (decay, trust), bucket in buckets.items():
        if not bucket["params"]:
            continue
        group = dict(options)
        group.update(bucket)
        group["weight_decay"] = weight_decay if decay else 0.0
        group["trust_ratio"] = trust
        groups.append(group)
    return groups
