"""GroupBERT's own settings: the `model.groupbert` section.

Shared shape keys (`hidden_size`, `num_layers`, `num_heads`, `intermediate_size`, ...) stay in
`model`; what only GroupBERT has lives here, as ModernBERT's lives in `model.modernbert`. Configs
written before this section existed (checkpoints' `config.yaml`) spell these keys flat in
`model`; `popbert.config` moves them here when it reads one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from popbert.rules import POSITIVE_INT, Invalid, check_fields, setting

if TYPE_CHECKING:
    from popbert.builders.bert_config import BertConfig


@dataclass
class GroupBertOptions:
    """The grouped FFN and the convolution module (Chelombiev et al. 2021's values)."""

    # Groups of the grouped (block-diagonal) FFN down-projection: they must divide
    # intermediate_size and hidden_size.
    ffn_groups: int = setting(4, POSITIVE_INT)
    # The convolution module's kernel (odd, so "same" padding is symmetric) and channels per
    # group of its grouped 1-D convolution.
    conv_kernel_size: int = setting(7, POSITIVE_INT)
    conv_group_size: int = setting(16, POSITIVE_INT)


def check_groupbert(config: BertConfig) -> None:
    """The GroupBERT keys, and that they divide the sizes they group."""
    options = config.groupbert
    check_fields(options, "model.groupbert")
    for size in ("intermediate_size", "hidden_size"):
        if getattr(config, size) % options.ffn_groups:
            raise Invalid(f"model.groupbert.ffn_groups ({options.ffn_groups}) must divide "
                          f"model.{size} ({getattr(config, size)})",
                          "model.groupbert.ffn_groups", f"model.{size}")
    if config.hidden_size % options.conv_group_size:
        raise Invalid(f"model.groupbert.conv_group_size ({options.conv_group_size}) must divide "
                      f"model.hidden_size ({config.hidden_size})",
                      "model.groupbert.conv_group_size", "model.hidden_size")
    if options.conv_kernel_size % 2 == 0:
        raise Invalid(f"model.groupbert.conv_kernel_size must be odd (\"same\" padding of k//2 "
                      f"each side), got {options.conv_kernel_size}",
                      "model.groupbert.conv_kernel_size")


__all__ = ["GroupBertOptions", "check_groupbert"]
