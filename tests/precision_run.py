"""A small seeded pre-training run at a chosen weight precision (tests and the curves script).

Everything but the weight storage is identical between runs: same initial weights (built in
FP32, then stored in the weight dtype), same batches, same dropout masks, FP32 compute and
FP32 optimizer moments.
"""

from __future__ import annotations

import torch

from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig
from popbert.data.loader import PretrainingLoader, load_or_create_instances
from popbert.optimizers import AdamW, Lamb, make_schedule, param_groups_by_name, set_lr
from popbert.runtime.session import SessionOptions, TrainingSession

SMALL = dict(vocab_size=8192, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128,
             max_position_embeddings=64, sequence_length=64, max_predictions_per_seq=10,
             hidden_dropout=0.0, attention_dropout=0.0)


def train_losses(weight_dtype: str, stochastic_rounding: bool, steps: int,
                 optimizer: str = "lamb", lr: float = 4e-3, model: dict | None = None,
                 micro_batch_size: int = 16, seed: int = 0) -> list[float]:
    """MLM+NSP loss per step of a seeded run on the bundled corpus."""
    config = BertConfig(**(model or SMALL))
    data = load_or_create_instances(None, None, config.sequence_length,
                                    config.max_predictions_per_seq, seed=1)
    loader = PretrainingLoader(data, micro_batch_size, seed=seed)
    torch.manual_seed(seed)
    graph = build_bert(config, seed=seed)
    schedule = make_schedule("linear", peak_lr=lr, total_steps=steps,
                             warmup_steps=max(1, steps // 10), warmup_start_lr=1e-6)
    cls = Lamb if optimizer == "lamb" else AdamW

    def make_optimizer(named):
        return cls(param_groups_by_name(named, 0.01), lr=lr, weight_decay=0.01,
                   bias_correction=optimizer != "lamb", stochastic_rounding=stochastic_rounding,
                   seed=seed)

    session = TrainingSession(graph.model(), "loss", make_optimizer,
                              SessionOptions(weight_dtype=weight_dtype))
    session.step_hook = lambda step: set_lr(session.optimizer, schedule, step)
    return [float(session.run(next(loader))["loss"][0]) for _ in range(steps)]
