"""What a sequence-length curriculum buys per step: a time-to-quality preset's model (`--config`:
`fast`, a ModernBERT, or `groupbert-fast`) trained on the same tokens as full rows or cut into
shorter rows (`training.sequence_curriculum`).

Real MLM-only rows of the Wikipedia text (`benchmarks/data/wiki-vital-train.txt.gz`), cut by
popbert's own curriculum (`popbert.train.curriculum.SequenceCurriculum`: same tokens per step,
masked anew), one session, the kinds' steps interleaved so machine noise hits all alike; median
step times and their ratio to full rows (< 1: the short rows are faster). Shorter rows save only
attention's work, whose share grows with the row length and with faster dense layers (a GPU).

    python benchmarks/curriculum_step.py                                # CPU, rows of 128
    python benchmarks/curriculum_step.py --sequence-length 512 --lengths 128 256
    python benchmarks/curriculum_step.py --device cuda --sequence-length 512 --lengths 128 256
    python benchmarks/curriculum_step.py --config groupbert-fast        # GroupBERT
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import popbert
from popbert.data import InstanceOptions, WordPieceTokenizer, read_documents
from popbert.data.instances import create_chunk_arrays
from popbert.train.curriculum import SequenceCurriculum

DATA = Path(__file__).resolve().parent / "data"


def config(preset: str, sequence_length: int, lengths: list[int],
           device: str) -> popbert.RunConfig:
    """`preset` at `sequence_length` (prediction slots scaled with its masking rate)."""
    predictions = round(sequence_length * popbert.load_config(preset).data.masked_lm_prob)
    return popbert.load_config(preset, [
        f"model.sequence_length={sequence_length}",
        f"model.max_position_embeddings={max(512, sequence_length)}",
        f"model.max_predictions_per_seq={predictions}", f"execution.device={device}",
        f"training.sequence_curriculum={[[0.5, n] for n in lengths][:1]}"])


def rows(cfg: popbert.RunConfig, count: int) -> dict[str, torch.Tensor]:
    tokenizer = WordPieceTokenizer()
    options = InstanceOptions(sequence_length=cfg.model.sequence_length,
                              max_predictions_per_seq=cfg.model.max_predictions_per_seq,
                              masked_lm_prob=cfg.data.masked_lm_prob, seed=7,
                              next_sentence=False)
    with tempfile.TemporaryDirectory() as work:
        text = Path(work) / "train.txt"
        text.write_bytes(gzip.decompress((DATA / "wiki-vital-train.txt.gz").read_bytes()))
        arrays = create_chunk_arrays(read_documents([text], tokenizer), tokenizer, options)
    return {k: torch.from_numpy(np.asarray(v[:count], np.int64)) for k, v in arrays.items()
            if k != "next_sentence_labels"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default="fast", choices=["fast", "groupbert-fast"],
                        help="the preset whose model is measured")
    args = parser.parse_args()
    cfg = config(args.config, args.sequence_length, args.lengths, args.device)
    # The run as `popbert pretrain` assembles it (graph with a dynamic sequence axis, session,
    # optimizer), in a scratch directory; its steps are then timed on rows cut by hand.
    with tempfile.TemporaryDirectory() as scratch, \
            popbert.Trainer.from_config(cfg, Path(scratch) / "run") as trainer:
        measure(trainer.session, cfg, args)


def measure(session: popbert.TrainingSession, cfg: popbert.RunConfig,
            args: argparse.Namespace) -> None:
    """Time the session's steps on full rows and on rows cut to each of `args.lengths`."""
    micro = cfg.execution.micro_batch_size
    data = rows(cfg, micro * (args.steps + args.warmup))
    cutters = {n: SequenceCurriculum(config(args.config, args.sequence_length, [n], args.device))
               for n in args.lengths}
    kinds = [args.sequence_length, *args.lengths]
    times: dict[int, list[float]] = {n: [] for n in kinds}
    for step in range(args.steps + args.warmup):
        full = {k: v[step * micro:(step + 1) * micro] for k, v in data.items()}
        order = kinds[step % len(kinds):] + kinds[:step % len(kinds)]
        for n in order:
            batch = full if n == args.sequence_length else cutters[n](full, 0.0, step)
            if session.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            session.run(batch)
            if session.device.type == "cuda":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times[n].append(time.perf_counter() - start)
    base = statistics.median(times[args.sequence_length])
    print(f"`{args.config}` model, {micro} rows of {args.sequence_length} a step, "
          f"{session.device}, threads {torch.get_num_threads()}, "
          f"median of {args.steps} interleaved steps")
    print("| rows | ms/step | ratio to full rows |")
    print("| --- | ---: | ---: |")
    for n in kinds:
        median = statistics.median(times[n])
        print(f"| {'full' if n == args.sequence_length else 'cut to'} {n} | {median * 1e3:.1f} | "
              f"{median / base:.3f} |")


if __name__ == "__main__":
    main()
