"""Training-step time: popbert's lowered ONNX graph vs Hugging Face BERT doing the same work.

One step = forward + backward + `torch.optim.AdamW(foreach=True)` step, same weights, same
padded batch, same dropout, same device and threads. popbert's MLM head works on the masked
positions only (Graphcore's and NVIDIA's layout), so the main peer is HF's `BertForPreTraining`
given the same head: the encoder, then the masked positions gathered, then `cls.predictions`
and the NSP classifier, cross-entropy over the real masked slots (what NVIDIA's BERT does).
`BertForPreTraining`'s own all-token head is a second, labelled column: it projects every
token onto the vocabulary, and a ratio against it flatters popbert for a reason that is not
the engine.

Steps of the three are interleaved so machine noise hits all alike; medians are printed with
the ratios popbert / HF (< 1 = popbert faster).

    python benchmarks/step_time.py                      # CPU: L4 H256, MiniLM shape, BERT-Base
    python benchmarks/step_time.py --compile both       # eager and torch.compile rows
    python benchmarks/step_time.py --device cuda --compute bfloat16 --cases base large
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bert_helpers import hf_labels, hf_model, padded_batch  # noqa: E402

from popbert.builders.bert import build_bert  # noqa: E402
from popbert.builders.bert_config import BertConfig  # noqa: E402
from popbert.hf.mapping import to_hf  # noqa: E402
from popbert.runtime.session import SessionOptions, TrainingSession  # noqa: E402

# name: (BertConfig fields, batch size); all at sequence length 128, 20 masked slots.
CASES: dict[str, tuple[str, dict, int]] = {
    "l4": ("L4 H256 A4, vocab 8192, batch 16",
           dict(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4,
                intermediate_size=1024), 16),
    "minilm": ("MiniLM shape L6 H384 A12, vocab 30522, batch 8",
               dict(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12,
                    intermediate_size=1536), 8),
    "base": ("BERT-Base L12 H768 A12, batch 4", dict(), 4),
    "base64": ("BERT-Base L12 H768 A12, batch 64", dict(), 64),
    "large": ("BERT-Large L24 H1024 A16, batch 32",
              dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096), 32),
}
DEFAULT_CPU_CASES = ["l4", "minilm", "base"]
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}

Step = Callable[[], None]


def masked_head_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF's encoder with the MLM head on the masked positions only: popbert's (and NVIDIA's)
    loss — mean cross-entropy over the real masked slots (label id 0 marks padding) plus NSP."""
    encoded = model.bert(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                         token_type_ids=batch["segment_ids"])
    sequence, pooled = encoded[0], encoded[1]
    positions = batch["masked_lm_positions"]
    gathered = torch.gather(sequence, 1,
                            positions[..., None].expand(-1, -1, sequence.shape[-1]))
    mlm_logits = model.cls.predictions(gathered)
    mlm = F.cross_entropy(mlm_logits.reshape(-1, mlm_logits.shape[-1]).float(),
                          batch["masked_lm_ids"].reshape(-1), ignore_index=0)
    nsp = F.cross_entropy(model.cls.seq_relationship(pooled).float(),
                          batch["next_sentence_labels"])
    return mlm + nsp


def make_steps(shape: dict, batch_size: int, device: str, dropout: float, compute: str,
               compile_: bool) -> dict[str, Step]:
    """Three training steps over one model's weights: popbert, HF masked head, HF all tokens."""
    config = BertConfig(**shape, sequence_length=128, max_predictions_per_seq=20,
                        hidden_dropout=dropout, attention_dropout=dropout)
    model = build_bert(config, seed=0).model()
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    options = SessionOptions(device=device, compute_dtype=compute, compile=compile_)
    ours = TrainingSession(model, "loss",
                           lambda p: torch.optim.AdamW([x for _, x in p], lr=1e-4, foreach=True),
                           options)
    batch = padded_batch(config, batch_size=batch_size, seed=1)
    ours_batch = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
    hf_batch = dict(input_ids=ours_batch["input_ids"], attention_mask=ours_batch["input_mask"],
                    token_type_ids=ours_batch["segment_ids"],
                    labels=hf_labels(batch, config.sequence_length).to(device),
                    next_sentence_label=ours_batch["next_sentence_labels"])
    dtype = DTYPES[compute]
    steps: dict[str, Step] = {"popbert": lambda: ours.run(ours_batch)}

    def hf_step(loss_of: Callable[[], torch.Tensor], optimizer) -> Step:
        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
                loss = loss_of()
            loss.backward()
            optimizer.step()
        return step

    hf_weights = to_hf(weights, config)
    for name, loss_fn in (("HF masked head", masked_head_loss),
                          ("HF all-token head", lambda m, _: m(**hf_batch).loss)):
        theirs = hf_model(config, hf_weights)
        theirs.config._attn_implementation = "sdpa"  # HF's default and fastest path
        theirs.to(device).train()
        optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-4, foreach=True)
        forward = torch.compile(loss_fn) if compile_ else loss_fn
        steps[name] = hf_step(lambda m=theirs, f=forward: f(m, ours_batch), optimizer)
    return steps


def timed(fn: Step, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(steps: dict[str, Step], device: str, warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds per step of each, the steps interleaved round-robin."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=None,
                        help=f"shapes to time (default on CPU: {' '.join(DEFAULT_CPU_CASES)}; "
                             "on CUDA: base64 large)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--compute", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--compile", choices=["off", "on", "both"], default="off",
                        help="popbert's execution.compile and torch.compile of the HF loss")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available on this machine")
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = args.cases or (DEFAULT_CPU_CASES if args.device == "cpu" else ["base64", "large"])
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]

    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"compute {args.compute}, dropout {args.dropout}, median of {args.steps} interleaved "
          "steps")
    print(f"| model | compile | popbert ms | HF masked-head ms | popbert / HF masked | "
          f"HF all-token ms | popbert / HF all-token |\n|{' --- |' * 2}{' ---: |' * 5}")
    for key in cases:
        name, shape, batch = CASES[key]
        for compile_ in compiles:
            torch.manual_seed(0)
            np.random.seed(0)
            t = measure(make_steps(shape, batch, args.device, args.dropout, args.compute,
                                   compile_), args.device, args.warmup, args.steps)
            ours, masked, full = t["popbert"], t["HF masked head"], t["HF all-token head"]
            print(f"| {name} | {'on' if compile_ else 'off'} | {ours * 1e3:.1f} | "
                  f"{masked * 1e3:.1f} | {ours / masked:.2f} | {full * 1e3:.1f} | "
                  f"{ours / full:.2f} |", flush=True)


if __name__ == "__main__":
    main()
