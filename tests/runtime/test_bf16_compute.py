"""BF16 compute on CPU: autocast really runs the matmuls in BF16, close to FP32, and trains like it.

`execution.compute_dtype: bfloat16` (`SessionOptions.compute_dtype`) runs a session's forward pass
under `torch.autocast("cpu", dtype=torch.bfloat16)`; the weights, their gradients and the
optimizer state stay FP32.

What BF16 changes, and the tolerances that follow. BF16 keeps 8 significant bits: its relative
spacing is u = 2^-8 ≈ 3.9e-3, and rounding to nearest errs by at most u/2 per element. CPU
autocast rounds the inputs of every matmul (linear, mm, the fused attention) to BF16 and returns
a BF16 result (accumulated in FP32 inside); GELU and the pooler's tanh then run on BF16. The
embeddings, the residual stream (adding a BF16 matmul output to the FP32 residual promotes to
FP32), the LayerNorms it feeds and the loss (in autocast's CPU FP32 list) stay FP32. So each layer
adds a few independent roundings of relative size <= u/2 that do not compound through the depth
(the residual is FP32), and the outputs carry a relative error of order u:

- MLM logits: ||bf16 - fp32|| / ||fp32|| <= 4u ≈ 1.6e-2 and cosine similarity >= 0.9999 (what
  4u of relative error allows: 1 - (4u)^2 / 2 ≈ 0.99988). Measured: 2.3e-3 (0.6u), 1 - cos 3e-6.
- the loss: within 2e-2 relative (≈ 5u; the mean of per-token log-probabilities, each off by
  about the logits' error). Measured: 1e-4.
- gradients: cosine similarity >= 0.999 for every tensor of >= 4096 elements, and the global
  norm within 4u. The backward pass goes through BF16 matmuls too, so each gradient is off by a
  few u (1 - cos ≈ (few u)^2 / 2 ≈ 1e-4). Measured: 1 - cos <= 1.3e-4, norm 3e-4.

None of this is vacuous: FP32 compute on weights each multiplied by (1 + 2^-5 · N(0, 1)) (the
error a 5-bit mantissa would make) fails the logits and gradient tolerances, and another batch
fails the loss one. The model compared is a 3-layer BERT fitted for a few FP32 steps to its batch,
so its loss (≈ 3.3) is well below the uniform log(vocab) ≈ 6.9 a fresh model sits at, where any
loss is within 2% of any other.

Training: 30 AdamW steps of a small BERT through `popbert.Trainer.from_config` on the bundled
corpus, FP32 and BF16 compute from the same seed and batches: the mean loss of the last 5 steps
agrees within 2% (per-step differences are of order u, far below the batch-to-batch noise;
measured: tails 8.2029 vs 8.2028, the largest per-step difference 8e-4), both fall by more than
1 nat from the first step (≈ 9.74 -> 8.20), the BF16 run is not bit-identical to the FP32 one,
and every matmul of its steps produced BF16 (autocast was on in the Trainer's session).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (one_thread: autouse)
from torch.utils._python_dispatch import TorchDispatchMode

import popbert
from popbert.builders.bert import build_bert
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

U = 2.0 ** -8  # BF16's relative spacing (8 significant bits)
LOGITS_REL, LOGITS_COS = 4 * U, 0.9999
LOSS_REL = 2e-2
GRAD_COS, GRAD_NORM_REL, LARGE = 0.999, 4 * U, 4096

# Matmul-like aten ops: what autocast lowers to BF16 (`linear` and `matmul` decompose into these;
# the attention is one fused `_scaled_dot_product_*` kernel forward and one backward, or bmm).
MATMULS = ("mm", "addmm", "bmm", "baddbmm")
ATTENTION = "_scaled_dot_product"


def is_matmul(op: str) -> bool:
    return op in MATMULS or op.startswith(ATTENTION)


class OpDtypes(TorchDispatchMode):
    """Records the dtypes of every aten op's tensor outputs (below autocast and autograd, so it
    sees what actually runs, backward included)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: Counter[tuple[str, torch.dtype]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        for value in out if isinstance(out, tuple | list) else [out]:
            if isinstance(value, torch.Tensor):
                self.outputs[name, value.dtype] += 1
                if name.startswith(ATTENTION):
                    break  # its other outputs (logsumexp, ...) are FP32 statistics
        return out

    def of(self, ops: tuple[str, ...] | Callable[[str], bool]) -> Counter[torch.dtype]:
        """Output dtypes (with counts) of the ops named in ``ops`` or that it accepts."""
        accepts = ops if callable(ops) else ops.__contains__
        counts: Counter[torch.dtype] = Counter()
        for (name, dtype), n in self.outputs.items():
            if accepts(name):
                counts[dtype] += n
        return counts

    def producing(self, dtype: torch.dtype) -> set[str]:
        return {name for name, d in self.outputs if d == dtype}


def adamw(named: list[tuple[str, torch.nn.Parameter]]) -> AdamW:
    return AdamW(param_groups_by_name(named, 0.01), lr=2e-3)


# ---------------------------------------------------------------------------------------------
# 1. The matmuls really run in BF16; weights, gradients and optimizer state stay FP32
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compute", ["bfloat16", "float32"])
def test_matmuls_run_in_the_compute_dtype_on_fp32_weights_and_optimizer_state(
        compute: str) -> None:
    config = small_config()
    session = TrainingSession(build_bert(config, seed=1).model(), "loss", adamw,
                              SessionOptions(compute_dtype=compute))
    recorded = OpDtypes()
    with recorded:
        outputs = session.run(padded_batch(config, 4))  # forward, backward and optimizer step
    dtype = getattr(torch, compute)
    matmuls = recorded.of(is_matmul)
    # Every matmul of the step (forward addmm, backward mm, attention both ways) in `compute`.
    assert set(matmuls) == {dtype}, matmuls
    for op, ran in (("addmm", ("addmm",)), ("mm", ("mm",)),
                    ("attention", lambda name: name.startswith(ATTENTION) or name == "bmm")):
        assert recorded.of(ran)[dtype] > 0, f"no {op} ran: {sorted(recorded.outputs)}"
    if compute == "float32":  # the negative control: nothing at all in BF16
        assert not recorded.producing(torch.bfloat16)
    else:
        assert set(recorded.of(("gelu", "tanh"))) == {torch.bfloat16}  # on BF16 matmul outputs
        # autocast's CPU FP32 list: the loss runs on an FP32 copy of the BF16 logits.
        for op in ("_log_softmax", "nll_loss_forward"):
            assert set(recorded.of((op,))) == {torch.float32}, (op, recorded.of((op,)))
    assert outputs["loss"].dtype == torch.float32
    # Weights, their gradients and the optimizer's moments: FP32 whatever the compute dtype.
    assert {w.dtype for w in session.weights().values()} == {torch.float32}
    params = [p for _, p in session.named_parameters]
    assert {p.grad.dtype for p in params if p.grad is not None} == {torch.float32}
    state = [v for s in session.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert len(state) >= 2 * len(params)  # exp_avg and exp_avg_sq of every weight
    assert {v.dtype for v in state} == {torch.float32}


# ---------------------------------------------------------------------------------------------
# 2. Numerics against the FP32 reference
# ---------------------------------------------------------------------------------------------

CONFIG = small_config(num_layers=3, hidden_size=128, num_heads=4, intermediate_size=512,
                      vocab_size=1000, sequence_length=64, max_position_embeddings=64,
                      max_predictions_per_seq=10)
BATCH = padded_batch(CONFIG, 8, seed=3)


@dataclass
class Pass:
    """One forward and backward pass: its loss, MLM logits (FP32 copy) and weight gradients."""

    loss: float
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def graph() -> onnx.ModelProto:
    return build_bert(CONFIG, seed=1).model()


@pytest.fixture(scope="module")
def fitted(graph: onnx.ModelProto) -> dict[str, torch.Tensor]:
    """Weights after 8 FP32 steps on BATCH: loss ≈ 3.3, against log(1000) ≈ 6.9 at the start."""
    session = TrainingSession(graph, "loss", adamw, SessionOptions())
    for _ in range(8):
        loss = float(session.run(BATCH)["loss"][0])
    assert loss < 0.6 * math.log(CONFIG.vocab_size), loss
    return {name: w.clone() for name, w in session.weights().items()}


def one_pass(graph: onnx.ModelProto, weights: Mapping[str, torch.Tensor], compute: str,
             batch: Mapping[str, np.ndarray] = BATCH) -> Pass:
    session = TrainingSession(graph, "loss", adamw, SessionOptions(compute_dtype=compute))
    session.load_weights(weights)
    outputs = session.forward(session.inputs.check(batch))
    outputs["loss"].backward()
    return Pass(float(outputs["loss"].detach()), outputs["mlm_logits"].detach().float(),
                {n: p.grad.clone() for n, p in session.named_parameters if p.grad is not None})


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.double() - reference.double()).norm() / reference.double().norm())


def disagreements(ours: Pass, reference: Pass) -> dict[str, str]:
    """What of ``ours`` is outside the BF16 tolerances around ``reference`` ({} = all within)."""
    failed: dict[str, str] = {}
    loss_rel = abs(ours.loss - reference.loss) / reference.loss
    if loss_rel > LOSS_REL:
        failed["loss"] = f"relative error {loss_rel:.2e} > {LOSS_REL}"
    logits_rel = relative_error(ours.logits, reference.logits)
    logits_cos = cosine(ours.logits, reference.logits)
    if logits_rel > LOGITS_REL or logits_cos < LOGITS_COS:
        failed["logits"] = f"relative error {logits_rel:.2e}, 1 - cos {1 - logits_cos:.1e}"
    large = [n for n, g in reference.grads.items() if g.numel() >= LARGE]
    assert len(large) >= 4 * CONFIG.num_layers, large  # QKV, Out, FF/1, FF/2 of every layer
    worst = min(large, key=lambda n: cosine(ours.grads[n], reference.grads[n]))
    worst_cos = cosine(ours.grads[worst], reference.grads[worst])
    norm = torch.cat([g.flatten() for g in reference.grads.values()]).norm()
    norm_rel = abs(float(torch.cat([ours.grads[n].flatten() for n in reference.grads]).norm()
                         / norm) - 1)
    if worst_cos < GRAD_COS or norm_rel > GRAD_NORM_REL:
        failed["gradients"] = (f"worst 1 - cos {1 - worst_cos:.1e} ({worst}), "
                               f"global norm off by {norm_rel:.1e}")
    return failed


def test_bf16_loss_logits_and_gradients_agree_with_fp32(
        graph: onnx.ModelProto, fitted: dict[str, torch.Tensor]) -> None:
    reference = one_pass(graph, fitted, "float32")
    bf16 = one_pass(graph, fitted, "bfloat16")
    assert disagreements(bf16, reference) == {}
    # ... and the BF16 pass is a different computation, not FP32 again.
    assert not torch.equal(bf16.logits, reference.logits)


def test_the_tolerances_catch_a_coarser_computation_and_another_batch(
        graph: onnx.ModelProto, fitted: dict[str, torch.Tensor]) -> None:
    reference = one_pass(graph, fitted, "float32")
    generator = torch.Generator().manual_seed(0)
    noisy = {n: w * (1 + 2.0 ** -5 * torch.randn(w.shape, generator=generator))
             for n, w in fitted.items()}
    coarse = disagreements(one_pass(graph, noisy, "float32"), reference)
    assert {"logits", "gradients"} <= set(coarse), coarse
    other = disagreements(one_pass(graph, fitted, "float32", padded_batch(CONFIG, 8, seed=4)),
                          reference)
    assert "loss" in other, other


# ---------------------------------------------------------------------------------------------
# 3. Training under BF16 follows FP32
# ---------------------------------------------------------------------------------------------

STEPS, TAIL = 30, 5
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=2",
         "model.intermediate_size=256", "model.sequence_length=64",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=10",
         "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
         "execution.micro_batch_size=16", "execution.device=cpu", "optimizer.lr=0.003",
         "optimizer.warmup_steps=3", f"training.steps={STEPS}", "training.log_every=1"]


def train(compute: str, output_dir: Path, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[list[float], Counter[torch.dtype]]:
    """The per-step losses of a short `tiny` run and the dtypes its steps' matmuls produced."""
    cfg = popbert.load_config("tiny", [*SMALL, f"execution.compute_dtype={compute}"])
    recorded = OpDtypes()
    with popbert.Trainer.from_config(cfg, output_dir) as trainer:
        assert trainer.session.options.compute_dtype == compute  # config -> session
        forward: Callable[..., dict[str, torch.Tensor]] = trainer.session.forward

        def recorded_forward(batch: Any) -> dict[str, torch.Tensor]:
            with recorded:
                return forward(batch)

        monkeypatch.setattr(trainer.session, "forward", recorded_forward)
        trainer.train()
    records = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in records], recorded.of(is_matmul)


def test_training_under_bf16_follows_fp32(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    fp32, fp32_matmuls = train("float32", tmp_path / "fp32", monkeypatch)
    bf16, bf16_matmuls = train("bfloat16", tmp_path / "bf16", monkeypatch)
    assert set(fp32_matmuls) == {torch.float32} and set(bf16_matmuls) == {torch.bfloat16}
    assert len(fp32) == len(bf16) == STEPS
    tail32, tail16 = float(np.mean(fp32[-TAIL:])), float(np.mean(bf16[-TAIL:]))
    for losses, tail in ((fp32, tail32), (bf16, tail16)):
        assert tail < losses[0] - 1.0, f"did not learn: first {losses[0]:.3f}, last {tail:.3f}"
    assert abs(tail16 - tail32) / tail32 < 0.02, (tail16, tail32)
    assert bf16 != fp32, "BF16 compute gave FP32's losses bit for bit: was autocast on?"
