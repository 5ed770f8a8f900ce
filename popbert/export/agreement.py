"""The one check every export passes before it is written: its outputs, in the runtime that will
serve it, against the torch backend's on the same sample batches.

Float exports (FP32, FP16, BF16) differ by rounding, so the largest difference is bounded
relative to the output's scale. INT8 exports move each output by a share of its size, not by
rounding noise, so their bound is on the RMS difference relative to the output's RMS. The
tolerances themselves belong to the exports (`popbert.export.inference`,
`popbert.export.openvino`), which say why each is what it is.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def check_agreement(reference: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray],
                    runtime: str, tolerance: float, *, relative_rms: bool = False) -> float:
    """The largest difference between `theirs` (from `runtime`) and the torch backend's
    `reference`, over every output of `reference`: the largest absolute difference, allowed
    `tolerance` times the output's largest magnitude (at least 1); with `relative_rms`, the RMS
    difference over the output's RMS (at least 1), allowed `tolerance`. RuntimeError, naming the
    output and the runtime, beyond it."""
    worst = 0.0
    for name, expected in reference.items():
        expected = np.asarray(expected)
        value = np.asarray(theirs[name])
        if relative_rms:
            rms = float(np.sqrt(np.mean(np.square(expected, dtype=np.float64))))
            difference = float(np.sqrt(np.mean(np.square(expected - value,
                                                          dtype=np.float64))))
            difference /= max(1.0, rms)
            allowed = tolerance
        else:
            difference = float(np.abs(expected - value).max())
            allowed = tolerance * max(1.0, float(np.abs(expected).max()))
        worst = max(worst, difference)
        if not difference <= allowed:
            raise RuntimeError(f"export check failed: output {name!r} differs between {runtime} "
                               f"and the torch backend by {difference:.3g} (> {allowed:.3g}"
                               f"{' relative RMS' if relative_rms else ''})")
    return worst


__all__ = ["check_agreement"]
