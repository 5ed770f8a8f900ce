"""Everything GPU-related in one run: phase-1 throughput and MFU, the fair HF peer, packing.

One table, one row per measurement:

* popbert phase 1 (sequence 128, 20 masked slots): BERT-Base and BERT-Large, BF16 compute with
  FP32 weights, `execution.compile`, popbert's own AdamW — sequences/s and MFU, where MFU's FLOPs
  are the training graph's own count (`popbert.plan`: 3 × the forward matmul FLOPs) over the
  GPU's dense BF16 peak;
* Hugging Face doing the same work: the encoder, the masked positions gathered, `cls.predictions`
  and NSP (the masked-only head, as NVIDIA's BERT), SDPA attention, `torch.compile`, BF16
  autocast, `torch.optim.AdamW(fused=True)` — same batch, same FLOPs;
* packed vs padded at sequence 512 on the bundled corpus: real (non-padding) tokens/s.

`benchmarks/gpu.sh` runs this and `benchmarks/optimizer_step.py` on one GPU. `--dry-run` runs
every row at toy shapes on the CPU in a minute (to check the script, not to measure anything).

    python benchmarks/gpu_suite.py                 # on a CUDA machine, ~5 minutes
    python benchmarks/gpu_suite.py --dry-run       # anywhere
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig
from popbert.config import load_config
from popbert.data.packing import PackingStats, pack_instance_arrays
from popbert.data.pretraining import load_training_data
from popbert.hf.mapping import to_hf
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.plan.flops import training_flops_per_sequence
from popbert.runtime.session import SessionOptions, TrainingSession

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from bert_helpers import hf_model, padded_batch  # noqa: E402


def _step_time_module():
    spec = importlib.util.spec_from_file_location("step_time", HERE / "step_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEP_TIME = _step_time_module()  # the fair HF peer and the timing, shared with step_time.py


# Dense BF16 tensor-core peaks (FLOP/s) from the vendors' data sheets, by device-name fragment.
PEAK_BF16 = {"H200": 989.4e12, "H100 PCIe": 756.0e12, "H100": 989.4e12, "A100": 312.0e12,
             "L40S": 362.0e12, "L4": 121.0e12, "A10": 125.0e12}

SHAPES = {
    "BERT-Base": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
    "BERT-Large": dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
    "toy": dict(vocab_size=8192, hidden_size=64, num_layers=2, num_heads=2,
                intermediate_size=256),
}

Step = Callable[[], object]


def peak_flops(device: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def seconds_per_step(step: Step, device: str, warmup: int, steps: int) -> float:
    """Median wall seconds of one step after `warmup` untimed ones (compilation included there):
    step_time's `measure` with a single contender."""
    return STEP_TIME.measure({"step": step}, device, warmup, steps)["step"]


def popbert_step(config: BertConfig, batch: dict[str, np.ndarray], device: str, compute: str,
                 compile_: bool) -> tuple[Step, int]:
    """A popbert training step (our AdamW, FP32 weights and moments) and its FLOPs/sequence."""
    model = build_bert(config, seed=0).model()
    flops = training_flops_per_sequence(model)
    session = TrainingSession(
        model, "loss",
        lambda named: AdamW(param_groups_by_name(named, 0.01), lr=1e-4, weight_decay=0.01),
        SessionOptions(device=device, compute_dtype=compute, compile=compile_))
    feed = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
    return (lambda: session.run(feed)), flops


def hf_step(config: BertConfig, batch: dict[str, np.ndarray], device: str, compute: str,
            compile_: bool, masked_head_loss: Callable) -> Step:
    """HF BERT with the masked-positions head, SDPA, BF16 autocast, fused AdamW."""
    import onnx

    weights = {t.name: onnx.numpy_helper.to_array(t)
               for t in build_bert(config, seed=0).model().graph.initializer}
    model = hf_model(config, to_hf(weights, config))
    model.config._attn_implementation = "sdpa"
    model.to(device).train()
    fused = device.startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  fused=fused, foreach=not fused)
    loss_of = torch.compile(masked_head_loss) if compile_ else masked_head_loss
    feed = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(compute)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            loss = loss_of(model, feed)
        loss.backward()
        optimizer.step()

    return step


def corpus_batches(sequence_length: int, predictions: int, batch_size: int,
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, PackingStats]:
    """A padded and a packed batch from the bundled corpus at this length, the packed batch's
    sequences-per-pack limit and the packing's statistics over the whole corpus."""
    cfg = load_config("tiny", [f"model.sequence_length={sequence_length}",
                               f"model.max_position_embeddings={sequence_length}",
                               f"model.max_predictions_per_seq={predictions}"])
    arrays = load_training_data(cfg)
    per_pack = 3
    packed, stats = pack_instance_arrays(arrays, max_sequences_per_pack=per_pack)
    padded = {k: v[:batch_size].astype(np.int64) for k, v in arrays.items()}
    packed = {k: v[:batch_size].astype(np.int64) for k, v in packed.items()}
    return padded, packed, per_pack, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true",
                        help="toy shapes on the CPU, 1 timed step: checks the script only")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense BF16 peak, when it is not in the built-in list")
    args = parser.parse_args()
    if args.dry_run:
        args.device, args.steps, args.warmup = "cpu", 1, 1
    elif args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_suite: CUDA is not available here (use --dry-run to check the script)")
    compute = "float32" if args.dry_run else "bfloat16"
    compile_ = not (args.no_compile or args.dry_run)
    peak = peak_flops(args.device, args.peak_tflops)
    masked_head_loss = STEP_TIME.masked_head_loss
    name = torch.cuda.get_device_name(torch.device(args.device)) \
        if args.device.startswith("cuda") else "CPU"
    print(f"device {name}, torch {torch.__version__}, compute {compute}, compile {compile_}, "
          f"median of {args.steps} steps after {args.warmup}, peak "
          f"{f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown (no MFU)'}"
          + ("  [DRY RUN: toy shapes on CPU, numbers mean nothing]" if args.dry_run else ""))
    print("| measurement | model | batch | ms/step | sequences/s | real tokens/s | MFU |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: |")

    def row(what: str, model_name: str, batch: dict[str, np.ndarray], seconds: float,
            flops: int | None) -> None:
        rows = batch["input_ids"].shape[0]
        real = int(batch["input_mask"].astype(bool).sum())
        mfu = f"{flops * rows / seconds / peak:.1%}" if (peak and flops) else "n/a"
        print(f"| {what} | {model_name} | {rows} | {seconds * 1e3:.1f} | {rows / seconds:.0f} | "
              f"{real / seconds:.0f} | {mfu} |", flush=True)

    cases = [("toy", 8)] if args.dry_run else [("BERT-Base", 128), ("BERT-Large", 64)]
    for model_name, batch_size in cases:
        config = BertConfig(**SHAPES[model_name], sequence_length=128,
                            max_predictions_per_seq=20)
        batch = padded_batch(config, batch_size=batch_size, seed=1)
        step, flops = popbert_step(config, batch, args.device, compute, compile_)
        row("popbert phase 1", model_name, batch,
            seconds_per_step(step, args.device, args.warmup, args.steps), flops)
        del step
        step = hf_step(config, batch, args.device, compute, compile_, masked_head_loss)
        row("HF masked head (SDPA, fused AdamW)", model_name, batch,
            seconds_per_step(step, args.device, args.warmup, args.steps), flops)
        del step
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # Packed vs padded at 512: the same model, rows of one sequence vs rows of up to three.
    seq, batch_size = (128, 4) if args.dry_run else (512, 32)
    model_name = "toy" if args.dry_run else "BERT-Base"
    padded, packed, per_pack, stats = corpus_batches(seq, 20 if args.dry_run else 76,
                                                     batch_size)
    print(f"(packing the bundled corpus at {seq}: padding {stats.padding_before:.1%} of token "
          f"slots → {stats.padding_after:.1%}, at most {stats.speedup:.2f}x real tokens/s)")
    packing = dict(packed=True, max_sequences_per_pack=per_pack,
                   max_predictions_per_seq=packed["masked_lm_ids"].shape[1])
    # Compiled, packed rows attend through the graph's dense block-diagonal mask; eager, per
    # sequence (popbert.lowering.block_attention), so both are measured.
    for what, batch, extra, compiled in (
            ("padded, bundled corpus", padded, {}, compile_),
            ("packed, bundled corpus, " + ("dense mask (compiled)" if compile_ else
                                            "per sequence where it pays (eager)"),
             packed, packing, compile_),
            ("packed, bundled corpus, per sequence (eager)", packed, packing, False)):
        if what.endswith("(eager)") and not compile_:
            continue  # the row above already ran eager, per sequence
        extra = dict(extra)
        config = BertConfig(**{**SHAPES[model_name], "vocab_size": 8192}, sequence_length=seq,
                            max_position_embeddings=seq,
                            max_predictions_per_seq=extra.pop("max_predictions_per_seq",
                                                              padded["masked_lm_ids"].shape[1]),
                            **extra)
        step, flops = popbert_step(config, batch, args.device, compute, compiled)
        row(f"popbert {what}", f"{model_name} seq {seq}", batch,
            seconds_per_step(step, args.device, args.warmup, args.steps), None)
        del step


if __name__ == "__main__":
    main()
