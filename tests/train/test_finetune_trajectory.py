"""A whole `popbert finetune` run trains as transformers' `Trainer` recipe does: from the real
all-MiniLM-L6-v2, on the same batches in the same order, every step's loss is the one
`BertFor*Classification` gets under the recipe `Trainer` runs (torch's AdamW, no decay on biases
and LayerNorm weights, `get_linear_schedule_with_warmup` over 10% of the steps, gradients clipped
to norm 1.0).

Dropout is off on both sides (its masks are random draws), so the steps are deterministic; the
head starts from popbert's fresh draw, copied into transformers' model. popbert runs its
micro-batches trimmed and in groups of similar length (`execution.trim_padding`), transformers
its padded batches: the losses agree to 2e-5 at every step (10 and 20 of them; measured: about
1e-6, FP32 sums in another order), while the loss moves by 100 times that over the run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import popbert
from popbert.train.finetune import EpochBatches

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# The file, transformers' class and the batch: 5 epochs of 4 sentences / 16 rows are 10 and 20
# steps, whose 10% warm-up is a whole number of steps (popbert rounds it down, as Google's BERT
# does; transformers up).
CASES = {"token-classification": (FIXTURES / "ner" / "sample.conll", "BertForTokenClassification",
                                  2),
         "classification": (FIXTURES / "classification" / "sentiment.tsv",
                            "BertForSequenceClassification", 4)}
EPOCHS, LR = 5, 1e-4


def popbert_steps(task: str, imported: Path, output: Path
                  ) -> tuple[list[float], dict[str, torch.Tensor], dict, list[str]]:
    """popbert's per-step losses, its fresh head, its training arrays and labels."""
    cfg = popbert.finetune_config(task, imported, CASES[task][0], overrides=[
        f"finetune.epochs={EPOCHS}", f"optimizer.lr={LR}",
        f"execution.micro_batch_size={CASES[task][2]}",
        "finetune.max_seq_length=64", "execution.device=cpu", "execution.trim_padding=true",
        "optimizer.eps=1e-8", "finetune.dropout=0.0", "training.log_every=1",
        "training.seed=3"])
    trainer = popbert.Trainer.from_config(cfg, output_dir=output)
    head = {name.rsplit("/", 1)[-1]: value.clone()
            for name, value in trainer.session.weights().items()
            if name.split("/")[-2:-1] == ["Classifier"]}
    arrays, labels = trainer.job.arrays, list(trainer.cfg.model.task.labels)
    trainer.train()
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return ([r["loss"] for r in records if "loss" in r and "step" in r], head, arrays,
            labels)


def transformers_steps(task: str, model_dir: Path, head: dict[str, torch.Tensor],
                       arrays: dict, labels: list[str]) -> list[float]:
    """The Trainer recipe's per-step losses on popbert's batches, in popbert's order."""
    import transformers

    model = getattr(transformers, CASES[task][1]).from_pretrained(
        str(model_dir), num_labels=len(labels), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        model.classifier.weight.copy_(head["W"].T)
        model.classifier.bias.copy_(head["B"])
    model.train()
    batches = list(EpochBatches(arrays, CASES[task][2], EPOCHS, 3))
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters()
             if not (n.endswith("bias") or "LayerNorm" in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, eps=1e-8)
    schedule = transformers.get_linear_schedule_with_warmup(
        optimizer, math.ceil(0.1 * len(batches)), len(batches))
    losses = []
    for batch in batches:
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                     token_type_ids=batch["segment_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.e2e
@pytest.mark.parametrize("task", sorted(CASES))
def test_every_step_is_the_trainer_recipes(task: str, minilm_dir: Path, minilm_imported: Path,
                                           tmp_path: Path) -> None:
    ours, head, arrays, labels = popbert_steps(task, minilm_imported, tmp_path / "ours")
    theirs = transformers_steps(task, minilm_dir, head, arrays, labels)
    assert len(ours) == len(theirs) and (0.1 * len(ours)).is_integer()
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 2e-5, (ours, theirs)
    assert max(abs(loss - ours[0]) for loss in ours) > 100 * 2e-5  # the steps train
