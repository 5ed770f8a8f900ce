"""popbert.optimizers: LAMB and AdamW in FP32, half weights with stochastic rounding, loss
scaling and learning-rate schedules.

The FP32 math lives in :mod:`popbert.optimizers.functional` and the whole steps (half weights,
tiling, compiled kernels; usable on shards) in :mod:`popbert.optimizers.steps`; :class:`Lamb`
and :class:`AdamW` are ``torch.optim.Optimizer`` subclasses built on them.
"""

from popbert.optimizers import functional
from popbert.optimizers.loss_scaling import LossScaler, grads_have_overflow, unscale_grads_
from popbert.optimizers.optimizer import AdamFamilyOptimizer, AdamW, Lamb, StableAdamW
from popbert.optimizers.param_groups import (
    DEFAULT_NO_DECAY,
    DEFAULT_NO_TRUST,
    classify_parameter,
    param_groups_by_name,
)
from popbert.optimizers.schedules import (
    Schedule,
    linear_scaling_rule,
    make_schedule,
    parse_piecewise,
    piecewise_constant,
    set_lr,
    warmup_decay,
    wsd_decay_start,
)
from popbert.optimizers.stochastic_rounding import (
    ROUNDING_SCHEME,
    hashed_round_fn,
    rounding_key,
    stochastic_round,
    stochastic_round_hashed,
)

__all__ = [
    "AdamFamilyOptimizer",
    "AdamW",
    "DEFAULT_NO_DECAY",
    "DEFAULT_NO_TRUST",
    "Lamb",
    "StableAdamW",
    "LossScaler",
    "ROUNDING_SCHEME",
    "Schedule",
    "classify_parameter",
    "functional",
    "grads_have_overflow",
    "hashed_round_fn",
    "linear_scaling_rule",
    "make_schedule",
    "param_groups_by_name",
    "parse_piecewise",
    "piecewise_constant",
    "rounding_key",
    "set_lr",
    "stochastic_round",
    "stochastic_round_hashed",
    "unscale_grads_",
    "warmup_decay",
    "wsd_decay_start",
]
