"""GroupBERT (`model.architecture: groupbert`): the graph against an independent PyTorch model.

Hugging Face has no GroupBERT, so the reference is written here from the paper's description
(Chelombiev et al. 2021) with `torch.nn.functional` ops only — not through the ONNX lowering —
and given the graph's weights by name. Also checked: the module order and grouped shapes on the
graph, that padding never reaches a real token through the convolution, the popart dialect,
placement annotations, the config checks, and a short CLI pre-training run with its export.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from bert_helpers import padded_batch, small_config
from test_popart_dialect import (
    as_declared,
    assert_gradients_close,
    checkpoints,
    placement_of_blocks,
    placement_of_weights,
    run_lowered,
)

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig
from popbert.builders.groupbert_config import GroupBertOptions
from popbert.cli.main import main
from popbert.config import dump_config, load_config
from popbert.graph.builder import GRAPHCORE_DOMAIN
from popbert.lowering import lower_to_fx

BATCH = 4


def config(**overrides) -> BertConfig:
    """Tiny GroupBERT: H 64 (4 conv groups of 16), I 128 in 4 FFN groups, kernel 7."""
    values = dict(architecture="groupbert",  # model.groupbert: 4 FFN groups, kernel 7, 16
                  initializer_range=0.2)
    values.update(overrides)
    return small_config(**values)


# ------------------------------------------------------------------- the independent reference


def reference_outputs(cfg: BertConfig, w: dict[str, torch.Tensor],
                      batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """GroupBERT pre-training forward from the paper's description, in plain PyTorch."""
    eps, h, heads = cfg.layer_norm_eps, cfg.hidden_size, cfg.num_heads
    ids = torch.from_numpy(batch["input_ids"])
    seg = torch.from_numpy(batch["segment_ids"])
    keep = torch.from_numpy(batch["input_mask"]).float()  # [B, S]
    batch_size, seq = ids.shape

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (h,), w[f"{name}/Gamma"], w[f"{name}/Beta"], eps)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ w[f"{name}/W"] + w[f"{name}/B"]

    x = (w["Embedding/Embedding_Dict"][ids] + w["Embedding/Positional_Dict"][:seq]
         + w["Embedding/Segment_Dict"][seg])
    x = ln(x, "Embedding/Norm")
    additive = (1.0 - keep)[:, None, None, :] * -10000.0
    for i in range(cfg.num_layers):
        p = f"Layer{i}"
        # Convolution module.
        y = ln(x, f"{p}/Conv/Norm")
        y = F.glu(linear(y, f"{p}/Conv/GLU"), dim=-1)
        y = y * keep[:, :, None]
        y = F.conv1d(y.transpose(1, 2), w[f"{p}/Conv/Conv/W"], w[f"{p}/Conv/Conv/B"],
                     padding=cfg.groupbert.conv_kernel_size // 2,
                     groups=h // cfg.groupbert.conv_group_size).transpose(1, 2)
        y = F.silu(ln(y, f"{p}/Conv/ConvNorm"))
        x = x + linear(y, f"{p}/Conv/Out")

        def ffn(x: torch.Tensor, name: str) -> torch.Tensor:
            y = F.gelu(linear(ln(x, f"{name}/Norm"), f"{name}/1"))
            groups = cfg.groupbert.ffn_groups
            # Block-diagonal: a [I, H] matrix with group g's [I/G, H/G] block on the diagonal.
            block = torch.block_diag(*w[f"{name}/Grouped/W"].unbind(0))
            assert block.shape == (cfg.intermediate_size, h) and groups > 1
            y = y @ block + w[f"{name}/Grouped/B"]
            return linear(y, f"{name}/Out")

        x = x + ffn(x, f"{p}/FFN1")
        # Attention module.
        y = linear(ln(x, f"{p}/Attention/Norm"), f"{p}/Attention/QKV")
        q, k, v = (t.reshape(batch_size, seq, heads, h // heads).transpose(1, 2)
                   for t in y.split(h, dim=-1))
        scores = q @ k.transpose(-1, -2) / (h // heads) ** 0.5 + additive
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch_size, seq, h)
        x = x + linear(context, f"{p}/Attention/Out")
        x = x + ffn(x, f"{p}/FFN2")
    x = ln(x, "FinalNorm")

    pooled = torch.tanh(linear(x[:, 0], "NSP/Pool"))
    nsp_logits = linear(pooled, "NSP/Cls")
    positions = torch.from_numpy(batch["masked_lm_positions"])
    masked = torch.gather(x, 1, positions[:, :, None].expand(-1, -1, h))
    masked = ln(F.gelu(linear(masked, "CLS/LMPrediction/Dense")), "CLS/LMPrediction/Norm")
    mlm_logits = masked @ w["Embedding/Embedding_Dict"].T + w["CLS/MLM/Bias"]
    labels = torch.from_numpy(batch["masked_lm_ids"])
    mlm_loss = F.cross_entropy(mlm_logits.reshape(-1, cfg.vocab_size), labels.reshape(-1),
                               ignore_index=0)
    nsp_loss = F.cross_entropy(nsp_logits, torch.from_numpy(batch["next_sentence_labels"]))
    return {"mlm_logits": mlm_logits, "nsp_logits": nsp_logits, "mlm_loss": mlm_loss,
            "nsp_loss": nsp_loss, "loss": mlm_loss + nsp_loss}


@pytest.mark.parametrize("num_layers", [1, 2])
def test_matches_an_independent_pytorch_groupbert(num_layers: int) -> None:
    torch.manual_seed(0)
    cfg = config(num_layers=num_layers)
    batch = padded_batch(cfg, BATCH, seed=5)
    assert batch["input_mask"].min() == 0  # padded rows, so zeroing the padding matters
    ours, our_grads, weights = run_lowered(build_bert(cfg, seed=3).model(), batch)

    leaves = {n: v.clone().requires_grad_(True) for n, v in weights.items()}
    theirs = reference_outputs(cfg, leaves, batch)
    theirs["loss"].backward()
    for name, expected in theirs.items():
        torch.testing.assert_close(ours[name], expected.detach(), atol=1e-5, rtol=0, msg=name)
    their_grads = {n: t.grad for n, t in leaves.items() if t.grad is not None}
    assert set(their_grads) == set(weights)  # every weight is used by the reference
    assert_gradients_close(our_grads, their_grads)


# ------------------------------------------------------------------------------- the graph


def test_module_order_and_grouped_shapes() -> None:
    cfg = config(num_layers=2)
    model = build_bert(cfg, zeros=True).model()
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    g, i, h = cfg.groupbert.ffn_groups, cfg.intermediate_size, cfg.hidden_size
    for ffn in ("FFN1", "FFN2"):
        assert shapes[f"Layer0/{ffn}/1/W"] == [h, i]
        assert shapes[f"Layer0/{ffn}/Grouped/W"] == [g, i // g, h // g]
        assert shapes[f"Layer0/{ffn}/Out/W"] == [h, h]
    assert shapes["Layer0/Conv/GLU/W"] == [h, 2 * h]
    assert shapes["Layer0/Conv/Conv/W"] == [h, cfg.groupbert.conv_group_size,
                                            cfg.groupbert.conv_kernel_size]
    assert shapes["Layer0/Attention/QKV/W"] == [h, 3 * h]
    assert shapes["FinalNorm/Gamma"] == [h]

    # Modules in order conv → FFN → attention → FFN, each starting with its own LayerNorm.
    modules: list[str] = []
    for node in model.graph.node:
        parts = node.name.split("/")
        if parts[0] == "Layer0" and (not modules or modules[-1] != parts[1]):
            modules.append(parts[1])
    assert modules == ["Conv", "FFN1", "Attention", "FFN2"]
    (conv,) = [n for n in model.graph.node if n.op_type == "Conv" and "Layer0" in n.name]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}
    assert attrs["group"] == h // cfg.groupbert.conv_group_size
    assert list(attrs["pads"]) == [cfg.groupbert.conv_kernel_size // 2] * 2
    # PreNorm: each module normalises its input x and its residual adds x itself (post-norm
    # would normalise the sum); the final LayerNorm reads the last residual.
    def node(prefix: str, op_type: str) -> onnx.NodeProto:
        (found,) = [n for n in model.graph.node
                    if n.name.startswith(prefix) and n.op_type == op_type]
        return found

    for module in modules:
        norm = node(f"Layer0/{module}/Norm/", "LayerNormalization")
        residual = node(f"Layer0/{module}/Residual", "Add")
        assert norm.input[0] in residual.input, module
    final = node("FinalNorm/", "LayerNormalization")
    assert final.input[0] == node("Layer1/FFN2/Residual", "Add").output[0]


def padded_positions_change_real_outputs() -> bool:
    """Whether changing the tokens at padded positions changes any real token's output."""
    cfg = config(num_layers=2)
    batch = padded_batch(cfg, BATCH, seed=5)
    inputs = {k: batch[k] for k in ("input_ids", "segment_ids", "input_mask")}
    module = lower_to_fx(build_bert(cfg, task="encoder", seed=3).model())

    def hidden(feed: dict[str, np.ndarray]) -> torch.Tensor:
        with torch.no_grad():
            return module.run({k: torch.from_numpy(v) for k, v in feed.items()})[
                "last_hidden_state"]

    changed = {**inputs, "input_ids": inputs["input_ids"].copy()}
    padded = inputs["input_mask"] == 0
    assert padded.any()
    changed["input_ids"][padded] = 7
    changed["segment_ids"] = np.where(padded, 1, inputs["segment_ids"])
    before, after = hidden(inputs), hidden(changed)
    real = torch.from_numpy(inputs["input_mask"] == 1)
    assert not torch.equal(before[~real], after[~real])  # the padded positions did change
    return float((after[real] - before[real]).abs().max()) > 1e-6


def test_padding_never_reaches_a_real_token() -> None:
    """Change the token at padded positions: every real token's output is unchanged (the
    convolution's window covers padding, which is zeroed before it)."""
    assert not padded_positions_change_real_outputs()


def test_negative_control_without_zeroing_padding_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: keep every position (no zeroing) and padding leaks through
    the convolution into the real tokens next to it."""
    from popbert.builders import layers

    def keep_all(b, input_mask: str) -> str:
        keep = original(b, input_mask)
        return b.aiOnnx.add([b.aiOnnx.sub([keep, keep]), layers.scalar(b, 1.0, np.float32,
                                                                         "all")])

    original = layers.padding_keep
    monkeypatch.setattr(layers, "padding_keep", keep_all)
    assert padded_positions_change_real_outputs()


def test_popart_dialect_checks_and_equals_the_onnx_dialect() -> None:
    placed = dict(num_layers=2, layers_per_ipu=[1, 1], recompute=True)
    cfg = config(**placed)
    batch = padded_batch(cfg, BATCH, seed=5)
    popart = build_bert(config(dialect="popart", **placed), seed=1, batch_size=BATCH).model()
    onnx.checker.check_model(popart, full_check=True)
    assert {o.domain: o.version for o in popart.opset_import} == {"": 11, GRAPHCORE_DOMAIN: 1}
    assert "Conv" in {n.op_type for n in popart.graph.node}
    reference = build_bert(cfg, seed=2).model()
    theirs, their_grads, weights = run_lowered(reference, batch)
    ours, our_grads, _ = run_lowered(popart, as_declared(popart, batch), weights)
    assert set(ours) == set(theirs)
    for name, expected in theirs.items():
        torch.testing.assert_close(ours[name], expected, atol=1e-5, rtol=0, msg=name)
    assert_gradients_close(our_grads, their_grads)
    assert placement_of_weights(popart) == placement_of_weights(reference)
    assert placement_of_blocks(popart) == placement_of_blocks(reference)


# ------------------------------------------------------------------------ packed sequences


def packed_setup(monkeypatch: pytest.MonkeyPatch | None = None, unmasked: bool = False):
    """Unpacked sequences, their packed rows, and both graphs' outputs with identical weights;
    `unmasked`: the packed convolution's same-sequence mask replaced by ones (a leaky conv)."""
    from packing_helpers import K, sequences

    from popbert.builders import layers
    from popbert.data.packing import pack_instance_arrays

    if unmasked:
        original = layers.packed_conv_keep

        def keep_all(b, sequence_index: str, kernel: int) -> str:
            keep = original(b, sequence_index, kernel)
            return b.aiOnnx.add([b.aiOnnx.sub([keep, keep]),
                                 layers.scalar(b, 1.0, np.float32, "all")])

        monkeypatch.setattr(layers, "packed_conv_keep", keep_all)
    cfg = config(max_predictions_per_seq=4)
    unpacked = sequences(cfg, 7, seed=3)
    packed, stats = pack_instance_arrays(unpacked, max_sequences_per_pack=K,
                                         max_predictions_per_pack=K * 4, seed=1)
    packed = {k: v.astype(np.int64) for k, v in packed.items()}
    assert stats.packs < stats.sequences
    plain = build_bert(cfg, seed=7).model()
    pack = build_bert(config(max_predictions_per_seq=K * 4, packed=True,
                             max_sequences_per_pack=K), seed=7).model()
    # The same conv weights ([H, conv_group_size, k]) under the same names: checkpoints move.
    assert ({t.name: list(t.dims) for t in plain.graph.initializer if "/W" in t.name}
            == {t.name: list(t.dims) for t in pack.graph.initializer if "/W" in t.name})
    out_u, _, weights = run_lowered(plain, unpacked)
    out_p, _, _ = run_lowered(pack, packed, weights)
    return unpacked, packed, out_u, out_p, pack


def test_packed_rows_give_the_unpacked_per_sequence_logits() -> None:
    """Each packed sequence's NSP logits and MLM logits equal those of the same sequence
    unpacked (1e-5): the convolution never reads a neighbouring sequence of the pack."""
    from packing_helpers import match_rows

    unpacked, packed, out_u, out_p, pack = packed_setup()
    assert packed["sequence_index"].max() > 1  # rows really hold several sequences
    # The unpacked graph keeps its one Conv per layer; the packed one adds the masked form.
    assert sum(n.op_type == "Conv" for n in pack.graph.node) > 2 * config().num_layers
    for key in ("loss", "mlm_loss", "nsp_loss"):
        assert abs(float(out_u[key]) - float(out_p[key])) <= 1e-5, key
    for src, (row, slot) in match_rows(unpacked, packed).items():
        torch.testing.assert_close(out_p["nsp_logits"][row, slot], out_u["nsp_logits"][src],
                                   atol=1e-5, rtol=0)
        start = int(packed["cls_positions"][row, slot])
        for q in range(int((unpacked["masked_lm_ids"][src] != 0).sum())):
            target = unpacked["masked_lm_positions"][src, q] + start
            slot_q = int(np.nonzero(packed["masked_lm_positions"][row] == target)[0][0])
            torch.testing.assert_close(out_p["mlm_logits"][row, slot_q],
                                       out_u["mlm_logits"][src, q], atol=1e-5, rtol=0)


def test_negative_control_an_unmasked_packed_conv_differs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a convolution that reads across the packed sequences (its
    same-sequence mask all ones) changes the losses far beyond the tolerance."""
    _, _, out_u, out_p, _ = packed_setup(monkeypatch, unmasked=True)
    assert abs(float(out_u["loss"]) - float(out_p["loss"])) > 1e-3


def test_packed_popart_dialect_checks_and_equals_the_onnx_dialect() -> None:
    from packing_helpers import K

    packed_cfg = dict(max_predictions_per_seq=K * 4, packed=True, max_sequences_per_pack=K)
    _, packed, _, theirs, reference = packed_setup()
    batch = len(packed["input_ids"])
    popart = build_bert(config(dialect="popart", **packed_cfg), seed=7, batch_size=batch).model()
    onnx.checker.check_model(popart, full_check=True)
    assert {o.domain: o.version for o in popart.opset_import} == {"": 11, GRAPHCORE_DOMAIN: 1}
    onnx.checker.check_model(reference, full_check=True)
    ours, _, _ = run_lowered(popart, as_declared(popart, packed))  # seed 7: same weights
    for name in ("loss", "mlm_logits", "nsp_logits"):
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=0, msg=name)


def test_placement_follows_layers_per_ipu() -> None:
    model = build_bert(config(num_layers=4, layers_per_ipu=[0, 2, 2], recompute=True),
                       zeros=True).model()
    blocks = placement_of_blocks(model)
    assert {("Layer0", 1, 1), ("Layer1", 1, 1), ("Layer2", 2, 2), ("Layer3", 2, 2),
            ("FinalNorm", 2, 2), ("Embedding", 0, 0), ("PaddingKeep", 0, 0)} <= blocks
    assert {("CLS", 0, 3), ("NSP", 0, 3)} <= blocks
    # Recompute checkpoints on each device's layers but its last.
    producers = {o: n.name for n in model.graph.node for o in n.output}
    marked = [n for n in model.graph.node if n.name in set(checkpoints(model))]
    assert [producers[n.input[0]].split("/")[0] for n in marked] == ["Layer0", "Layer2"]


@pytest.mark.parametrize("overrides, message", [
    ({"groupbert": GroupBertOptions(ffn_groups=3)},
     "model.groupbert.ffn_groups (3) must divide model.intermediate_size (128)"),
    ({"groupbert": GroupBertOptions(conv_group_size=24)},
     "model.groupbert.conv_group_size (24) must divide model.hidden_size (64)"),
    ({"groupbert": GroupBertOptions(conv_kernel_size=6)},
     "model.groupbert.conv_kernel_size must be odd"),
    ({"groupbert": GroupBertOptions(ffn_groups=0)},
     "model.groupbert.ffn_groups must be a positive integer"),
    ({"architecture": "funnel"}, "model.architecture must be one of bert, groupbert"),
])
def test_config_errors_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        config(**overrides).validate()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bert_ignores_the_groupbert_keys() -> None:
    small_config(groupbert=GroupBertOptions(ffn_groups=3, conv_group_size=24)).validate()


def test_the_flat_spelling_of_older_configs_is_read_into_model_groupbert(tmp_path, caplog) -> None:
    """Checkpoints' config.yaml written before `model.groupbert` existed, a user's file and
    `--set` with the old keys all still load, into the new section."""
    old = tmp_path / "old.yaml"
    old.write_text("preset: groupbert-mini\nmodel:\n  ffn_groups: 2\n  conv_kernel_size: 5\n")
    g = load_config(old).model.groupbert
    assert (g.ffn_groups, g.conv_kernel_size, g.conv_group_size) == (2, 5, 16)
    with caplog.at_level("WARNING", logger="popbert"):
        g = load_config("groupbert-mini", ["model.conv_group_size=32"]).model.groupbert
    assert g.conv_group_size == 32
    assert "the key is now model.groupbert.conv_group_size" in caplog.text
    # --set of the new key wins over a file's old spelling.
    g = load_config(old, ["model.groupbert.ffn_groups=8"]).model.groupbert
    assert (g.ffn_groups, g.conv_kernel_size) == (8, 5)
    dumped = dump_config(load_config(old))
    assert "groupbert:\n    ffn_groups: 2" in dumped and "\n  ffn_groups" not in dumped


@pytest.mark.parametrize("preset, shape", [
    ("groupbert-mini", (4, 256, 1024, 4)), ("groupbert-medium", (8, 512, 2048, 8)),
    ("groupbert-base-128", (12, 768, 3072, 12)), ("groupbert-base-384", (12, 768, 3072, 12))])
def test_presets(preset: str, shape: tuple[int, int, int, int]) -> None:
    cfg = load_config(preset)
    m = cfg.model
    assert m.architecture == "groupbert"
    assert (m.num_layers, m.hidden_size, m.intermediate_size, m.num_heads) == shape
    g = m.groupbert
    assert (g.ffn_groups, g.conv_kernel_size, g.conv_group_size) == (4, 7, 16)
    assert m.hidden_dropout == m.attention_dropout == 0.0  # no dropout in pre-training
    if preset.startswith("groupbert-base"):
        assert cfg.optimizer.name == "lamb" and cfg.optimizer.lr == 0.012
        assert cfg.optimizer.warmup_steps == 1000 and cfg.optimizer.decay == "polynomial"
        assert cfg.optimizer.loss_scale == 512
    if preset == "groupbert-base-128":
        assert cfg.training.steps == 7032


# ------------------------------------------------------------------------------- the CLI run

SMALL = ["--set", "model.num_layers=2", "--set", "model.hidden_size=32",
         "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
         "--set", "model.sequence_length=32", "--set", "model.max_position_embeddings=32",
         "--set", "model.max_predictions_per_seq=5", "--set", "execution.micro_batch_size=8",
         "--set", "execution.device=cpu", "--set", "training.log_every=1",
         "--set", "optimizer.warmup_steps=2", "--set", "optimizer.lr=0.003",
         "--set", "training.steps=30"]


@pytest.mark.e2e
def test_pretrain_groupbert_mini_through_the_cli(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["pretrain", "--config", "groupbert-mini", *SMALL, "--output-dir", str(run)]) == 0
    losses = [json.loads(line)["loss"] for line in
              (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert len(losses) >= 30
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    exported = run / "model.inference.onnx"
    assert exported.exists()  # written and verified in ONNX Runtime by the run
    model = onnx.load(str(exported))
    assert {"Conv", "Attention"} <= {n.op_type for n in model.graph.node}
    assert "FinalNorm/Gamma" in {t.name for t in model.graph.initializer}

    # `popbert export` of another task and length: written and verified in ONNX Runtime.
    encoder = tmp_path / "encoder.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", "encoder", "--output",
                 str(encoder), "--sequence-length", "24", "--batch-size", "2"]) == 0
    assert encoder.exists()

    # Hugging Face has no GroupBERT: export-hf is a one-line error.
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export-hf", "--checkpoint", str(run), "--output-dir", str(out)]) != 0
    error = capsys.readouterr().err.strip()
    assert "model.architecture is 'groupbert'" in error and len(error.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("task", ["squad", "classification", "encoder"])
def test_fine_tuning_heads_with_dropout(task: str) -> None:
    """BERT's task heads sit on the GroupBERT encoder unchanged; fine-tuning's dropout lands
    after every module (4 per layer) and in the embeddings."""
    from popbert.builders.bert_config import TaskConfig

    extra = {"task": TaskConfig(name="classification", num_labels=3)} \
        if task == "classification" else {}
    cfg = config(hidden_dropout=0.1, attention_dropout=0.1, **extra)
    model = build_bert(cfg, task=task, with_loss=False, seed=1).model()
    dropouts = [n.name for n in model.graph.node if n.op_type == "Dropout"]
    for module in ("Conv", "FFN1", "Attention", "FFN2"):
        assert any(name.startswith(f"Layer1/{module}/Dropout") for name in dropouts), module
    batch = padded_batch(cfg, BATCH, seed=5)
    module = lower_to_fx(model)
    module.eval()
    with torch.no_grad():
        outputs = module.run({n: torch.from_numpy(batch[n]) for n in module.input_names})
    assert outputs and all(torch.isfinite(v).all() for v in outputs.values())


def test_import_hf_of_a_groupbert_config_is_a_one_line_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "groupbert"}))
    assert main(["import-hf", "--model", str(model_dir), "--output-dir",
                 str(tmp_path / "out")]) != 0
    error = capsys.readouterr().err.strip()
    assert "groupbert" in error and len(error.splitlines()) == 1, error


@pytest.mark.e2e
def test_pipelined_recomputed_training_gives_the_same_losses(tmp_path: Path) -> None:
    """Stages from `layers_per_ipu` (the padding mask crosses them like the attention mask),
    pipelined with recomputation: the same loss curve as one device."""
    common = [*SMALL, "--set", "training.steps=3", "--set", "model.layers_per_ipu=[1,1]",
              "--set", "model.recompute=true", "--set", "execution.gradient_accumulation=4"]
    losses = {}
    for name, extra in [("plain", []), ("pipelined", ["--set", "execution.pipeline=true",
                                                       "--set", "execution.recompute=true"])]:
        assert main(["pretrain", "--config", "groupbert-mini", *common, *extra,
                     "--output-dir", str(tmp_path / name)]) == 0
        losses[name] = [json.loads(line)["loss"] for line in
                        (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["plain"]) == 3
    np.testing.assert_allclose(losses["pipelined"], losses["plain"], rtol=1e-5, atol=0)


def test_fine_tuning_a_groupbert_checkpoint_turns_dropout_on() -> None:
    """Pre-trained without dropout, fine-tuned with 0.1 unless --dropout says otherwise; BERT
    keeps its checkpoint's dropout."""
    from popbert.builders.bert_config import TaskConfig
    from popbert.train.finetune import GROUPBERT_FINETUNE_DROPOUT, task_model_config

    task = TaskConfig(name="squad")
    group = config(hidden_dropout=0.0, attention_dropout=0.0)
    tuned = task_model_config(group, group.sequence_length, task)
    assert tuned.hidden_dropout == tuned.attention_dropout == GROUPBERT_FINETUNE_DROPOUT
    assert task_model_config(group, group.sequence_length, task, dropout=0.0).hidden_dropout == 0
    bert = BertConfig(**{**group.__dict__, "architecture": "bert"})
    assert task_model_config(bert, bert.sequence_length, task).hidden_dropout == 0.0
