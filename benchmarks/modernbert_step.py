"""Training-step time of popbert's ModernBERT against `transformers.ModernBertForMaskedLM` doing
the same work.

One step = forward + backward + `torch.optim.AdamW(foreach=True)` step. Both sides get the same
weights (Hugging Face's random initialisation mapped onto popbert's names by
`popbert.hf.mapping.from_hf_architecture`), the same rows and the same masked positions, FP32,
dropout 0, the same threads. Hugging Face runs with `attn_implementation="sdpa"` and
`sparse_prediction=True`, so its head projects only the masked tokens (labels -100 elsewhere),
as popbert's does; the loss of the first step must agree to 1e-4 (relative) before anything is
timed, or the script stops.

Row sets, micro-batches of the shape's batch size at sequence length 128 (20 MLM slots, Google's 15%
masking rule, `popbert.data.instances.mask_arrays`):

- **full length**: every row 128 real tokens (no padding; random token ids), popbert's static
  graph;
- **real lengths, shuffled**: Wikipedia article leads of the bundled corpus
  (`benchmarks/data/topic-train.jsonl`, ~76% real tokens at 128) in a shuffled order; popbert
  builds the graph with a symbolic sequence axis and runs each micro-batch cut to its longest
  row, rounded up to a multiple of 8 (`execution.trim_padding`, `PaddingTrimmer`);
- **real lengths, grouped by length**: the same rows, batches of similar length
  (`popbert.data.loader.length_grouped_order`, what `finetune.group_by_length` does), trimmed.

On real-length rows Hugging Face gets the batch padded to 128 with its attention mask (its
ModernBERT skips padding only through flash-attention, which a CPU lacks); a second HF column
gives it the same cut batch popbert runs (what its `DataCollatorWithPadding(padding="longest",
pad_to_multiple_of=8)` would hand it): that ratio is engine against engine, the first one also
counts the padding popbert does not compute.

Steps are interleaved round-robin (`step_time.measure`) so machine noise hits all alike; medians
and the ratios popbert / HF (< 1 = popbert faster) are printed as a markdown table.

    python benchmarks/modernbert_step.py --threads 2 --steps 10          # small shape
    python benchmarks/modernbert_step.py --threads 2 --shapes small large
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import measure  # noqa: E402  (interleaved round-robin medians)

from popbert.builders.bert import build_bert  # noqa: E402
from popbert.builders.bert_config import BertConfig  # noqa: E402
from popbert.builders.modernbert_config import ModernBertOptions  # noqa: E402
from popbert.data.classification import (  # noqa: E402
    encode_classification,
    read_classification_file,
)
from popbert.data.instances import InstanceOptions, mask_arrays  # noqa: E402
from popbert.data.loader import length_grouped_order  # noqa: E402
from popbert.data.tokenization import WordPieceTokenizer, bundled_vocab_path  # noqa: E402
from popbert.hf.mapping import from_hf_architecture  # noqa: E402
from popbert.runtime.inputs import TRIM_MULTIPLE, PaddingTrimmer  # noqa: E402
from popbert.runtime.options import SessionOptions  # noqa: E402
from popbert.runtime.session import TrainingSession  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
SEQUENCE = 128
PREDICTIONS = 20
LOSS_RTOL = 1e-4
ROW_SETS = ("full length", "real lengths, shuffled", "real lengths, grouped by length")
CAVEAT = ("caveat: Hugging Face's ModernBERT computes padding tokens unless it runs with "
          "flash-attention (CUDA only), which a CPU lacks; on real-length rows its padded column "
          "therefore includes work popbert's trimmed batch skips, and the 'HF on the cut batch' "
          "column is the engine-against-engine ratio.")


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    window: int  # local_attention: tokens a sliding-window layer sees (half each side)
    batch: int


SHAPES: dict[str, Shape] = {
    "small": Shape("L4 H256 A4 I384, vocab 8192, window 64, batch 16", 4, 256, 4, 384, 8192,
                   64, 16),
    "large": Shape("L6 H384 A6 I576, vocab 30522, window 128, batch 8", 6, 384, 6, 576, 30522,
                   128, 8),
    # For tests: seconds, not minutes.
    "tiny": Shape("L2 H64 A2 I96, vocab 8192, window 16, batch 4", 2, 64, 2, 96, 8192, 16, 4),
}


def popbert_config(shape: Shape) -> BertConfig:
    return BertConfig(architecture="modernbert", next_sentence_prediction=False,
                      vocab_size=shape.vocab, hidden_size=shape.hidden, num_layers=shape.layers,
                      num_heads=shape.heads, intermediate_size=shape.intermediate,
                      max_position_embeddings=512, sequence_length=SEQUENCE,
                      max_predictions_per_seq=PREDICTIONS, hidden_dropout=0.0,
                      attention_dropout=0.0, layer_norm_eps=1e-5,
                      modernbert=ModernBertOptions(local_attention=shape.window,
                                                   global_attn_every_n_layers=3,
                                                   global_rope_theta=160000.0,
                                                   local_rope_theta=10000.0))


def hf_config(shape: Shape, tokenizer: WordPieceTokenizer):
    """The same model as `transformers.ModernBertConfig`: SDPA attention, dropout 0, the MLM
    head on the masked tokens only."""
    import transformers

    return transformers.ModernBertConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        max_position_embeddings=512, local_attention=shape.window, global_attn_every_n_layers=3,
        global_rope_theta=160000.0, local_rope_theta=10000.0, norm_eps=1e-5,
        embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0,
        pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.cls_id,
        eos_token_id=tokenizer.sep_id, cls_token_id=tokenizer.cls_id,
        sep_token_id=tokenizer.sep_id, sparse_prediction=True, sparse_pred_ignore_index=-100,
        attn_implementation="sdpa")


# ----------------------------------------------------------------------------- rows


def masked(arrays: dict[str, np.ndarray], tokenizer: WordPieceTokenizer, seed: int
           ) -> dict[str, np.ndarray]:
    """`arrays` (input_ids, input_mask) with Google's MLM masking applied: 15% of each row's real
    tokens (at most 20) in the prediction slots, label id 0 in the unused ones."""
    rows = {k: arrays[k].astype(np.int64) for k in ("input_ids", "input_mask")}
    rows["masked_lm_positions"] = np.zeros((len(rows["input_ids"]), PREDICTIONS), np.int64)
    rows["masked_lm_ids"] = np.zeros_like(rows["masked_lm_positions"])
    options = InstanceOptions(sequence_length=SEQUENCE, max_predictions_per_seq=PREDICTIONS,
                              masked_lm_prob=0.15, whole_word_mask=False)
    mask_arrays(rows, tokenizer, options, np.random.default_rng(seed))
    return rows


def full_rows(count: int, tokenizer: WordPieceTokenizer, seed: int) -> dict[str, np.ndarray]:
    """Rows of 128 real tokens: [CLS], random non-special ids, [SEP]."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(max(tokenizer.special_ids) + 1, tokenizer.vocab_size, (count, SEQUENCE))
    ids[:, 0], ids[:, -1] = tokenizer.cls_id, tokenizer.sep_id
    return masked({"input_ids": ids, "input_mask": np.ones_like(ids)}, tokenizer, seed)


def corpus_rows(tokenizer: WordPieceTokenizer, seed: int) -> dict[str, np.ndarray]:
    """The bundled Wikipedia leads as [CLS] text [SEP] rows, padded (or cut) to 128, masked."""
    data = read_classification_file(DATA / "topic-train.jsonl")
    return masked(encode_classification(data, tokenizer, SEQUENCE), tokenizer, seed)


def micro_batches(rows: dict[str, np.ndarray], order: np.ndarray, batch: int, count: int
                  ) -> list[dict[str, np.ndarray]]:
    """`count` micro-batches of `batch` rows taken in `order` (wrapping around if short)."""
    chosen = np.resize(order, count * batch)
    return [{k: v[chosen[i * batch:(i + 1) * batch]] for k, v in rows.items()}
            for i in range(count)]


def hf_labels(batch: dict[str, np.ndarray]) -> np.ndarray:
    """[batch, sequence] labels: the masked token's id at each used slot's position, -100
    (ignored) elsewhere."""
    labels = np.full(batch["input_ids"].shape, -100, np.int64)
    rows, slots = np.nonzero(batch["masked_lm_ids"])
    labels[rows, batch["masked_lm_positions"][rows, slots]] = batch["masked_lm_ids"][rows, slots]
    return labels


# ----------------------------------------------------------------------------- steps


@dataclass
class Stepper:
    """One side's training step, fed the next of its micro-batches each call (cycling); keeps
    the last step's loss tensor."""

    run: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    batches: list[dict[str, torch.Tensor]]
    calls: int = 0
    last: torch.Tensor | None = None

    def __call__(self) -> None:
        self.last = self.run(self.batches[self.calls % len(self.batches)])
        self.calls += 1


def popbert_session(config: BertConfig, weights: dict[str, torch.Tensor], trim: bool
                    ) -> TrainingSession:
    """popbert's MLM-only ModernBERT training graph, `weights` loaded; `trim`: a symbolic
    sequence axis and each micro-batch cut to its longest row (`execution.trim_padding`)."""
    graph = build_bert(config, seed=0, dynamic_sequence=trim)
    session = TrainingSession(
        graph.model(), graph.loss,
        lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-4, foreach=True),
        SessionOptions(device="cpu", trim_padding=trim))
    session.load_weights(weights, strict=True)
    return session


def popbert_stepper(session: TrainingSession, batches: list[dict[str, torch.Tensor]]
                    ) -> Stepper:
    return Stepper(lambda batch: session.run(batch)[session.loss_name][0], batches)


def hf_stepper(model, batches: list[dict[str, torch.Tensor]],
               cut: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None
               ) -> Stepper:
    """A fresh copy of `model` trained on popbert's micro-batches as `transformers` takes them
    (labels at the masked positions, -100 elsewhere): padded to 128, or cut as `cut` cuts
    them (labels cut to the same width)."""
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    feeds = []
    for batch in batches:
        width = (cut(batch) if cut is not None else batch)["input_mask"].shape[1]
        labels = torch.from_numpy(hf_labels({k: v.numpy() for k, v in batch.items()}))
        feeds.append({"input_ids": batch["input_ids"][:, :width].contiguous(),
                      "attention_mask": batch["input_mask"][:, :width].contiguous(),
                      "labels": labels[:, :width].contiguous()})

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Stepper(step, feeds)


def check_losses(steppers: dict[str, Stepper], reference: str, rtol: float = LOSS_RTOL
                 ) -> dict[str, float]:
    """The first step's loss of every side, which must equal `reference`'s to `rtol`
    (relative): otherwise the two do not compute the same thing and no time is worth printing."""
    losses = {name: float(s.last) for name, s in steppers.items()}
    expected = losses[reference]
    bad = {name: value for name, value in losses.items()
           if not abs(value - expected) <= rtol * abs(expected)}
    if bad:
        raise RuntimeError(f"loss check failed (first step, relative tolerance {rtol:g}): "
                           f"{reference} {expected!r}, but {bad}")
    return losses


def run_shape(shape: Shape, args: argparse.Namespace, tokenizer: WordPieceTokenizer
              ) -> list[dict]:
    """Every row set on `shape`: one table row each (printed), and its figures."""
    import transformers

    config = popbert_config(shape)
    torch.manual_seed(0)
    reference = transformers.ModernBertForMaskedLM(hf_config(shape, tokenizer))
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    mapped, missing = from_hf_architecture(state, config, "ModernBertForMaskedLM")
    if missing:
        raise RuntimeError(f"popbert weights with no Hugging Face tensor: {missing}")
    weights = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in mapped.items()}

    count = args.warmup + args.steps
    corpus = corpus_rows(tokenizer, seed=1)
    order = np.random.default_rng(2).permutation(len(corpus["input_ids"]))
    grouped = length_grouped_order(order, corpus["input_mask"].sum(axis=1), shape.batch,
                                   np.random.default_rng(3))
    row_sets = {
        ROW_SETS[0]: micro_batches(full_rows(count * shape.batch, tokenizer, seed=4),
                                   np.arange(count * shape.batch), shape.batch, count),
        ROW_SETS[1]: micro_batches(corpus, order, shape.batch, count),
        ROW_SETS[2]: micro_batches(corpus, grouped, shape.batch, count),
    }
    results = []
    for rows, arrays in row_sets.items():
        if rows not in args.rows:
            continue
        trim = rows != ROW_SETS[0]
        batches = [{k: torch.from_numpy(v) for k, v in b.items()} for b in arrays]
        session = popbert_session(config, weights, trim)
        steppers = {"popbert": popbert_stepper(session, batches),
                    "HF": hf_stepper(reference, batches, None)}
        cut = PaddingTrimmer(session.inputs.specs) if trim else None
        if cut is not None:
            steppers["HF, cut batch"] = hf_stepper(reference, batches, cut)
        for stepper in steppers.values():  # the first step of each: the loss check
            stepper()
        losses = check_losses(steppers, "HF")
        times = measure(steppers, "cpu", max(args.warmup - 1, 0), args.steps)
        timed = batches[args.warmup:] or batches
        widths = [(cut(b) if cut is not None else b)["input_mask"].shape[1] for b in timed]
        result = {"shape": shape.name, "rows": rows,
                  "real_tokens": float(np.mean([b["input_mask"].float().mean() for b in timed])),
                  "popbert_width": float(np.mean(widths)), "losses": losses,
                  "popbert_s": times["popbert"], "hf_s": times["HF"],
                  "hf_cut_s": times.get("HF, cut batch")}
        results.append(result)
        print(table_row(result), flush=True)
    return results


HEADER = ("| shape | rows | real tokens | popbert width | popbert ms | HF padded ms | "
          "popbert / HF padded | HF on the cut batch ms | popbert / HF cut |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def table_row(r: dict) -> str:
    ours, padded, cut = r["popbert_s"], r["hf_s"], r["hf_cut_s"]
    cut_cells = ("— | —" if cut is None
                 else f"{cut * 1e3:.1f} | **{ours / cut:.2f}**")
    return (f"| {r['shape']} | {r['rows']} | {r['real_tokens']:.0%} | "
            f"{r['popbert_width']:.0f} | {ours * 1e3:.1f} | {padded * 1e3:.1f} | "
            f"**{ours / padded:.2f}** | {cut_cells} |")


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["small"],
                        help="model shapes to time (default: small; tiny is for tests)")
    parser.add_argument("--rows", nargs="+", choices=ROW_SETS, default=list(ROW_SETS),
                        help="row sets to time (default: all three)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps of each first (at least 1: the loss check)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    tokenizer = WordPieceTokenizer(bundled_vocab_path())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, cpu, threads "
          f"{torch.get_num_threads()}, FP32, dropout 0, sequence {SEQUENCE}, {PREDICTIONS} MLM "
          f"slots, median of {args.steps} interleaved steps after {args.warmup} untimed; "
          f"first-step losses equal to {LOSS_RTOL:g} (checked); popbert width: mean of its "
          f"micro-batches cut to their longest row, rounded up to {TRIM_MULTIPLE}")
    print(CAVEAT)
    print(HEADER)
    results = []
    for key in args.shapes:
        results.extend(run_shape(SHAPES[key], args, tokenizer))
    return results


if __name__ == "__main__":
    main()
