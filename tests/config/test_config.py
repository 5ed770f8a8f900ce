"""Config loading, presets, validation errors and `--set` overrides (popbert.config)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from popbert.atomic import atomic_write_text
from popbert.config import (
    DEFAULT_PRESET,
    RunConfig,
    TaskConfig,
    apply_overrides,
    config_from_dict,
    dump_config,
    list_presets,
    load_config,
    parse_lr_schedule,
    parse_override,
    preset_path,
)
from popbert.config.yaml_io import DuplicateKeyError, load_yaml
from popbert.errors import ConfigError, PopbertError

PRESETS = ["tiny", "base-128", "base-384", "large-128", "large-384", "groupbert-mini",
           "groupbert-medium", "groupbert-base-128", "groupbert-base-384", "finetune-squad",
           "finetune-classification", "finetune-token-classification", "fast",
           "groupbert-fast", "modernbert-base", "finetune-embedding"]


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(config: str | Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, overrides or [])
    message = str(info.value)
    assert "\n" not in message, "config errors must be one line"
    return message


# ---------------------------------------------------------------------------------------------
# Presets


def test_all_presets_are_shipped() -> None:
    assert sorted(PRESETS) == list_presets()
    for name in PRESETS:
        assert preset_path(name).is_file()


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_validates(name: str) -> None:
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    cfg.validate()
    assert cfg.global_batch_size == (
        cfg.execution.micro_batch_size
        * cfg.execution.replicas
        * cfg.execution.gradient_accumulation
    )
    if cfg.training.global_batch_size is not None:
        assert cfg.training.global_batch_size == cfg.global_batch_size


def test_tiny_preset_is_a_small_fp32_cpu_run() -> None:
    cfg = load_config("tiny")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size) == (2, 128, 2, 512)
    assert (m.sequence_length, m.max_predictions_per_seq, m.vocab_size) == (128, 20, 8192)
    assert m.layers_per_ipu is None
    assert m.hidden_dropout == pytest.approx(0.1)
    assert cfg.execution.device == "cpu"
    assert cfg.execution.weight_dtype == cfg.execution.compute_dtype == "float32"
    assert not cfg.execution.use_stochastic_rounding
    assert cfg.execution.micro_batch_size == 32
    assert 1e-3 <= cfg.optimizer.lr <= 2e-3
    assert 0 < cfg.optimizer.warmup_steps <= cfg.training.steps // 5
    assert cfg.data.input_files == [] and cfg.data.vocab_file is None


@pytest.mark.parametrize(
    "name,layers,hidden,heads,inter,placement,scale",
    [
        ("base-128", 12, 768, 12, 3072, [0, 4, 4, 4], 512.0),
        ("base-384", 12, 768, 12, 3072, [0, 4, 4, 4], 512.0),
        ("large-128", 24, 1024, 16, 4096, [3, 7, 7, 7], 64.0),
        ("large-384", 24, 1024, 16, 4096, [3, 7, 7, 7], 64.0),
    ],
)
def test_bert_presets_follow_graphcore(
    name: str, layers: int, hidden: int, heads: int, inter: int, placement: list[int], scale: float
) -> None:
    cfg = load_config(name)
    m, o, e, t = cfg.model, cfg.optimizer, cfg.execution, cfg.training
    assert (m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size) == (
        layers,
        hidden,
        heads,
        inter,
    )
    assert m.vocab_size == 30522
    assert m.layers_per_ipu == placement
    assert o.name == "lamb" and o.bias_correction is False
    assert o.weight_decay == pytest.approx(0.01) and o.eps == pytest.approx(1e-6)
    assert o.loss_scaling == "static" and o.loss_scale == scale
    assert o.warmup_start_lr == pytest.approx(1e-7) and o.end_lr == pytest.approx(1e-7)
    assert o.decay == "linear" and o.max_grad_norm is None
    assert e.weight_dtype == "float16" and e.use_stochastic_rounding
    if name.endswith("-128"):
        assert (m.sequence_length, m.max_predictions_per_seq) == (128, 20)
        assert (o.lr, o.warmup_steps, t.steps, t.global_batch_size) == (0.006, 2000, 7038, 65536)
    else:
        assert (m.sequence_length, m.max_predictions_per_seq) == (384, 56)
        assert (o.lr, o.warmup_steps, t.steps, t.global_batch_size) == (0.002828, 274, 2137, 16384)
    assert cfg.global_batch_size == t.global_batch_size


# ---------------------------------------------------------------------------------------------
# Files


def test_partial_file_is_laid_over_tiny_and_reads_yaml12_floats(tmp_path: Path) -> None:
    path = write(
        tmp_path, "optimizer:\n  lr: 1e-3\n  warmup_steps: 5\ntraining:\n  steps: 20\ntracking:\n"
    )
    cfg = load_config(path)
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 1e-3
    assert (cfg.training.steps, cfg.optimizer.warmup_steps) == (20, 5)
    tiny = load_config("tiny")
    assert cfg.preset == DEFAULT_PRESET == "tiny"
    assert cfg.model == tiny.model and cfg.model.vocab_size == 8192  # the bundled vocabulary
    assert cfg.data == tiny.data and cfg.execution == tiny.execution
    assert cfg.optimizer.name == "adamw" and cfg.optimizer.bias_correction is True
    assert cfg.tracking == tiny.tracking  # a bare `tracking:` line changes nothing
    assert cfg.training.global_batch_size is None
    assert cfg.global_batch_size == 32


def test_steps_only_file_is_a_tiny_run(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "training: {steps: 10}\n"), ["optimizer.warmup_steps=2"])
    tiny = load_config("tiny")
    assert cfg.training.steps == 10
    assert cfg.preset == "tiny" and cfg.model == tiny.model and cfg.data == tiny.data


def test_preset_key_picks_the_base(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "preset: base-128\ntraining:\n  steps: 10\n"))
    base = load_config("base-128")
    assert cfg.preset == "base-128" and cfg.training.steps == 10
    assert cfg.model == base.model and cfg.optimizer == base.optimizer
    assert cfg.training.global_batch_size == 65536
    # Nested mappings merge key by key over the preset's.
    cfg = load_config(write(tmp_path, "preset: large-128\nmodel:\n  recompute: false\n", "l.yaml"))
    assert cfg.model.recompute is False and cfg.model.num_layers == 24


def test_null_preset_means_dataclass_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "preset: null\ntraining:\n  steps: 10\n"))
    assert cfg.preset is None
    assert cfg.model.hidden_size == 768 and cfg.model.vocab_size == 30522  # BertConfig defaults
    assert cfg.optimizer.name == "lamb"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_by_name_records_itself(name: str) -> None:
    cfg = load_config(name)
    assert cfg.preset == name
    assert dump_config(cfg).startswith(f"preset: {name}\n")


def test_unknown_preset_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, "preset: base-129\ntraining:\n  steps: 10\n")
    message = error_of(path)
    assert message == (f"{path}: preset: unknown preset 'base-129'; presets: "
                       f"{', '.join(sorted(PRESETS))}")
    assert "unknown preset 3" in error_of(write(tmp_path, "preset: 3\n", "n.yaml"))


def test_int_is_accepted_for_float(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "optimizer:\n  lr: 1\n  loss_scale: 128\n"))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert isinstance(cfg.optimizer.loss_scale, float)


def test_empty_file_is_the_default_preset(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == load_config(DEFAULT_PRESET)
    # A dict is not laid over a preset: missing keys take the dataclass defaults.
    assert config_from_dict({}) == RunConfig()


def test_unknown_key_names_file_key_and_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "optimizer:\n  lrr: 0.1\n")
    message = error_of(path)
    assert message.startswith(f"{path}: unknown key optimizer.lrr")
    assert "did you mean 'lr'" in message
    assert "valid keys:" in message and "weight_decay" in message and "warmup_steps" in message


def test_unknown_key_in_model_section(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, "model:\n  hidden: 64\n"))
    assert "unknown key model.hidden" in message and "hidden_size" in message


def test_unknown_section(tmp_path: Path) -> None:
    path = write(tmp_path, "optimiser:\n  lr: 0.1\n")
    message = error_of(path)
    assert message.startswith(f"{path}: unknown key optimiser")
    assert "did you mean 'optimizer'" in message
    for section in ("preset", "model", "data", "optimizer", "execution", "training", "tracking"):
        assert section in message


@pytest.mark.parametrize(
    "text,expected",
    [
        ("optimizer:\n  lr: abc\n", "optimizer.lr: expected float, got 'abc'"),
        ("optimizer:\n  lr: '0.001'\n", "optimizer.lr: expected float, got '0.001'"),
        ("optimizer:\n  lr: true\n", "optimizer.lr: expected float, got True"),
        ("model:\n  hidden_size: 64.0\n", "model.hidden_size: expected int, got 64.0"),
        ("model:\n  hidden_size: '64'\n", "model.hidden_size: expected int, got '64'"),
        ("training:\n  steps: true\n", "training.steps: expected int, got True"),
        ("execution:\n  compile: 1\n", "execution.compile: expected bool, got 1"),
        ("execution:\n  compile: yes\n", "execution.compile: expected bool, got 'yes'"),
        ("execution:\n  threads: two\n", "execution.threads: expected int or null, got 'two'"),
        (
            "optimizer:\n  max_grad_norm: big\n",
            "optimizer.max_grad_norm: expected float or null, got 'big'",
        ),
        ("optimizer:\n  betas: 0.9\n", "optimizer.betas: expected list of float, got 0.9"),
        (
            "optimizer:\n  betas: [0.9, x]\n",
            "optimizer.betas: expected list of float, got [0.9, 'x']",
        ),
        (
            "model:\n  layers_per_ipu: [1, 1.5]\n",
            "model.layers_per_ipu: expected list of int or null, got [1, 1.5]",
        ),
        ("data:\n  input_files: a.h5\n", "data.input_files: expected list of str, got 'a.h5'"),
        ("tracking:\n  project: 3\n", "tracking.project: expected str, got 3"),
        ("training:\n  steps: null\n", "training.steps: expected int, got None"),
    ],
)
def test_wrong_type(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}: {expected}"


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("optimizer.name", "sgd", "lamb, adamw, stableadamw"),
        ("optimizer.decay", "exponential", "linear, polynomial, none, cosine, wsd"),
        ("optimizer.loss_scaling", "auto", "none, static, dynamic"),
        ("execution.backend", "jax", "torch, popart"),
        ("execution.device", "tpu", "cpu, cuda, auto, cuda:N"),
        ("execution.device", "cuda:one", "cpu, cuda, auto, cuda:N"),
        ("execution.weight_dtype", "fp16", "float32, float16, bfloat16"),
        ("execution.compute_dtype", "half", "float32, float16, bfloat16"),
        ("tracking.backend", "mlflow", "none, wandb"),
    ],
)
def test_bad_enum(tmp_path: Path, key: str, value: str, allowed: str) -> None:
    section, name = key.split(".")
    path = write(tmp_path, f"{section}:\n  {name}: {value}\n")
    assert error_of(path) == f"{path}: {key}: expected one of {allowed}, got {value!r}"


def test_a_gpu_by_index_is_a_device() -> None:
    """As `popbert.runtime.devices.resolve_device` reads it (whether this machine has it is
    the run's question, not the config's)."""
    assert load_config("tiny", ["execution.device=cuda:1"]).execution.device == "cuda:1"


@pytest.mark.parametrize(
    "text,fragment",
    [
        (
            "model:\n  hidden_size: 100\n  num_heads: 3\n",
            "model.hidden_size (100) must be divisible by model.num_heads (3)",
        ),
        ("model:\n  num_layers: 4\n  layers_per_ipu: [1, 1]\n", "model.layers_per_ipu [1, 1]"),
        ("model:\n  sequence_length: 1024\n", "model.sequence_length (1024) exceeds"),
        ("optimizer:\n  lr: 0\n", "optimizer.lr must be > 0"),
        ("optimizer:\n  betas: [0.9]\n", "optimizer.betas must be two values"),
        ("optimizer:\n  lr_schedule: '0:1e-3,x'\n", "optimizer.lr_schedule '0:1e-3,x'"),
        ("optimizer:\n  lr_schedule: '100:1e-3,50:1e-4'\n", "steps must increase"),
        ("data:\n  masked_lm_prob: 1.5\n", "data.masked_lm_prob must be in (0, 1]"),
        ("execution:\n  micro_batch_size: 0\n", "execution.micro_batch_size must be >= 1"),
        ("execution:\n  pipeline: true\n", "execution.pipeline needs model.layers_per_ipu"),
        ("execution:\n  backend: popart\n", "execution.backend 'popart' needs model.dialect"),
        ("training:\n  log_every: 0\n", "training.log_every must be >= 1"),
        ("training:\n  seed: -1\n", "training.seed must be from 0 to 2147483647"),
        ("data:\n  seed: -5\n", "data.seed must be from 0 to 2147483647"),
        ("model:\n  layer_norm_eps: 0\n", "model.layer_norm_eps must be > 0"),
        ("model:\n  initializer_range: -0.02\n", "model.initializer_range must be >= 0"),
        ("execution:\n  threads: 100000\n", "execution.threads must be from 1 to 1024"),
        ("serve:\n  threads: 0\n", "serve.threads must be from 1 to 1024"),
        ("serve:\n  workers: 5000\n", "serve.workers must be from 1 to 1024"),
    ],
)
def test_invalid_values(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    message = error_of(path)
    assert message.startswith(f"{path}: ")
    assert fragment in message


def _int_keys(cls: type, prefix: str = "") -> list[str]:
    """Every integer setting of a config dataclass, dotted (nested sections included)."""
    import dataclasses
    import typing

    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += _int_keys(tp, f"{prefix}{name}.")
        elif tp is int or (typing.get_origin(tp) is not None and int in typing.get_args(tp)
                           and bool not in typing.get_args(tp)):
            keys.append(f"{prefix}{name}")
    return keys


INT_KEYS = _int_keys(RunConfig)


def test_the_integer_settings_are_found() -> None:
    assert {"training.seed", "execution.threads", "model.max_position_embeddings",
            "model.task.num_labels", "serve.port"} <= set(INT_KEYS)


@pytest.mark.parametrize("value", [2**31, -(2**31), 10**20])
def test_no_integer_setting_takes_what_a_c_int_does_not_hold(value: int) -> None:
    """A few extra digits in any integer (a thread count, a size, a seed) is one line naming
    the key, not an overflow inside torch or NumPy."""
    for key in INT_KEYS:
        message = error_of("tiny", [f"{key}={value}"])
        assert f"{key}: expected an integer from -2147483647 to 2147483647" in message, message


def test_global_batch_not_divisible(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "execution:\n  micro_batch_size: 32\n  replicas: 2\ntraining:\n  global_batch_size: 100\n",
    )
    message = error_of(path)
    assert "training.global_batch_size (100) is not divisible by" in message
    assert "= 64" in message


def test_global_batch_mismatch_suggests_accumulation(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "execution:\n  micro_batch_size: 32\n  replicas: 2\n"
        "  gradient_accumulation: 2\ntraining:\n  global_batch_size: 256\n",
    )
    message = error_of(path)
    assert "training.global_batch_size (256) !=" in message and "= 128" in message
    assert "execution.gradient_accumulation=4" in message
    fixed = load_config(path, ["execution.gradient_accumulation=4"])
    assert fixed.global_batch_size == 256


def test_missing_file_lists_presets(tmp_path: Path) -> None:
    message = error_of(tmp_path / "nope.yaml")
    assert message.startswith("config file not found:") and "nope.yaml" in message
    assert "base-128" in message and "tiny" in message
    assert "config file not found: not-a-preset" in error_of("not-a-preset")


def test_invalid_yaml_and_non_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "optimizer:\n  lr: [1, 2\n")
    message = error_of(path)
    assert message.startswith(f"{path}: invalid YAML at line")
    assert "expected a mapping of sections" in error_of(write(tmp_path, "- 1\n- 2\n", "l.yaml"))
    assert "section optimizer must be a mapping" in error_of(
        write(tmp_path, "optimizer: 3\n", "s.yaml")
    )


def test_errors_are_popbert_and_value_errors(tmp_path: Path) -> None:
    with pytest.raises(PopbertError):
        load_config(write(tmp_path, "model:\n  num_heads: 5\n"))
    with pytest.raises(ValueError):
        load_config(write(tmp_path, "model:\n  num_heads: 5\n"))


# ---------------------------------------------------------------------------------------------
# Overrides


def test_overrides_apply_with_yaml_syntax() -> None:
    cfg = load_config(
        "tiny",
        [
            "optimizer.lr=2e-3",
            "model.layers_per_ipu=[1,1]",
            "optimizer.max_grad_norm=null",
            "data.input_files=[a/*.hdf5, b.hdf5]",
            "tracking.run_name=my run",
            "execution.compile=true",
            "optimizer.lr_schedule=0:1e-4,100:1e-5",
            "model.task.name=squad",
            "model.task.doc_stride=64",
            "training.steps=20",
        ],
    )
    assert cfg.optimizer.lr == 2e-3
    assert cfg.model.layers_per_ipu == [1, 1]
    assert cfg.optimizer.max_grad_norm is None
    assert cfg.data.input_files == ["a/*.hdf5", "b.hdf5"]
    assert cfg.tracking.run_name == "my run"
    assert cfg.execution.compile is True
    assert cfg.optimizer.lr_schedule == "0:1e-4,100:1e-5"
    assert cfg.model.task == TaskConfig(name="squad", doc_stride=64)
    assert cfg.training.steps == 20
    # The preset itself is untouched.
    assert load_config("tiny").optimizer.max_grad_norm is not None


def test_later_override_wins_and_fixes_file(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  hidden_size: 100\n  num_heads: 3\n")
    cfg = load_config(path, ["model.num_heads=5", "model.num_heads=4"])
    assert cfg.model.num_heads == 4


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("optimizer.lr", "expected section.key=value"),
        ("lr=0.1", "expected section.key=value"),
        ("optimizer.=0.1", "expected section.key=value"),
        ("=0.1", "expected section.key=value"),
        ("optimizer.lr=", "missing value"),
        ("model.layers_per_ipu=[1,1", "is not a YAML value"),
    ],
)
def test_bad_override_syntax(override: str, fragment: str) -> None:
    message = error_of("tiny", [override])
    assert message.startswith(f"bad --set {override!r}: ")
    assert fragment in message


@pytest.mark.parametrize(
    "override,expected",
    [
        ("optimizer.lr=abc", "--set optimizer.lr=abc: optimizer.lr: expected float, got 'abc'"),
        (
            "optimizer.lrr=1",
            "--set optimizer.lrr=1: unknown key optimizer.lrr (did you mean 'lr'?)",
        ),
        ("optim.lr=1", "--set optim.lr=1: unknown key optim"),
        ("optimizer.name=sgd", "--set optimizer.name=sgd: optimizer.name: expected one of"),
        ("model.num_heads=3", "--set model.num_heads=3: model.hidden_size (128) must be divisible"),
        ("model.num_layers.x=1", "--set model.num_layers.x=1: model.num_layers is not a mapping"),
        ("training.global_batch_size=64", "--set training.global_batch_size=64: training."),
    ],
)
def test_override_errors_name_the_override(override: str, expected: str) -> None:
    assert error_of("tiny", [override]).startswith(expected)


def test_parse_override_and_apply_copy() -> None:
    assert parse_override("optimizer.betas=[0.8, 0.99]") == (["optimizer", "betas"], [0.8, 0.99])
    assert parse_override("tracking.run_name=a=b") == (["tracking", "run_name"], "a=b")
    raw = {"optimizer": {"lr": 0.1}}
    out = apply_overrides(raw, ["optimizer.lr=0.2", "training.steps=3"])
    assert out == {"optimizer": {"lr": 0.2}, "training": {"steps": 3}}
    assert raw == {"optimizer": {"lr": 0.1}}


# ---------------------------------------------------------------------------------------------
# Round trips and helpers


@pytest.mark.parametrize("name", PRESETS)
def test_saved_config_reloads_equal(tmp_path: Path, name: str) -> None:
    cfg = load_config(
        name,
        [
            "optimizer.max_trust_ratio=10",
            "tracking.run_name=yes",
            "data.input_files=['a b/*.hdf5', '1e-3']",
            "optimizer.lr_schedule=0:1e-4,100:1e-5",
            "model.task.labels=[a, '1e-3']",
            "model.task.num_labels=2",
        ],
    )
    assert cfg.tracking.run_name == "yes" and cfg.data.input_files == ["a b/*.hdf5", "1e-3"]
    path = atomic_write_text(tmp_path / "run" / "config.yaml", dump_config(cfg))
    assert path.is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp")]
    assert load_config(path) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg
    assert dump_config(cfg) == path.read_text()
    # yaml.safe_load (YAML 1.1, e.g. a checkpoint reader) reads the same values back.
    assert config_from_dict(yaml.safe_load(path.read_text())) == cfg


def test_to_dict_has_every_section() -> None:
    d = load_config("tiny").to_dict()
    assert list(d) == ["preset", "model", "data", "optimizer", "execution", "training",
                       "tracking"]
    assert d["preset"] == "tiny"
    assert d["optimizer"]["betas"] == [0.9, 0.999]


def test_decay_cosine_and_wsd_with_its_fraction() -> None:
    cfg = load_config("tiny", ["optimizer.decay=wsd", "optimizer.decay_fraction=0.3"])
    assert cfg.optimizer.decay == "wsd" and cfg.optimizer.decay_fraction == 0.3
    assert load_config("tiny", ["optimizer.decay=cosine"]).optimizer.decay == "cosine"
    assert load_config("tiny").optimizer.decay_fraction == 0.2  # the default, for every decay
    assert load_config("tiny", ["optimizer.decay_fraction=1"]).optimizer.decay_fraction == 1.0
    for bad, shown in (("0", "0.0"), ("1.5", "1.5"), ("-0.2", "-0.2")):
        override = f"optimizer.decay_fraction={bad}"
        assert error_of("tiny", ["optimizer.decay=wsd", override]) == (
            f"--set {override}: optimizer.decay_fraction must be in (0, 1], got {shown}")


def test_a_config_saved_before_decay_fraction_still_loads(tmp_path: Path) -> None:
    """Runs saved before `optimizer.decay_fraction` existed resume with its default."""
    old = load_config("tiny").to_dict()
    del old["optimizer"]["decay_fraction"]
    path = write(tmp_path, yaml.safe_dump(old, sort_keys=False))
    assert load_config(path).optimizer.decay_fraction == 0.2
    assert config_from_dict(old) == load_config("tiny")
    assert "  decay_fraction: 0.2\n" in dump_config(load_config(path))  # re-saved with the key


def test_parse_lr_schedule() -> None:
    assert parse_lr_schedule("0:1e-7, 2000:0.006,5000:0.001") == [
        (0, 1e-7),
        (2000, 0.006),
        (5000, 0.001),
    ]
    for bad in ("", "10", "a:1", "1:b", "-1:0.1", "5:0.1,5:0.2"):
        with pytest.raises(ValueError):
            parse_lr_schedule(bad)


def test_stochastic_rounding_default_follows_weight_dtype() -> None:
    cfg = load_config("tiny", ["execution.weight_dtype=bfloat16"])
    assert cfg.execution.use_stochastic_rounding
    cfg = load_config(
        "tiny", ["execution.weight_dtype=bfloat16", "execution.stochastic_rounding=false"]
    )
    assert not cfg.execution.use_stochastic_rounding


def test_only_the_running_config_warns(caplog: pytest.LogCaptureFixture) -> None:
    """A config is validated wherever it is read, a checkpoint's stored one too (export,
    fine-tuning, sweeps): its questionable settings are said only by the job that runs it."""
    from popbert.train.pretrain import PretrainingJob

    with caplog.at_level(logging.WARNING, logger="popbert"):
        cfg = load_config("tiny", ["training.steps=2"])
        config_from_dict(cfg.to_dict())
        assert caplog.messages == []
        PretrainingJob(cfg)
    assert caplog.messages == ["optimizer.warmup_steps (30) exceeds training.steps (2): the run "
                               "ends before reaching the peak learning rate"]


# ---------------------------------------------------------------------------------------------
# Non-finite numbers and duplicate keys


@pytest.mark.parametrize("text,shown", [(".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan")])
def test_non_finite_in_file(tmp_path: Path, text: str, shown: str) -> None:
    path = write(tmp_path, f"optimizer:\n  lr: {text}\n")
    assert error_of(path) == f"{path}: optimizer.lr must be a finite number, got {shown}"
    # Anywhere: in a list, in an int key, in a nested mapping.
    path = write(tmp_path, f"optimizer:\n  betas: [0.9, {text}]\n", "b.yaml")
    assert error_of(path) == f"{path}: optimizer.betas[1] must be a finite number, got {shown}"
    path = write(tmp_path, f"training:\n  steps: {text}\n", "s.yaml")
    assert error_of(path) == f"{path}: training.steps must be a finite number, got {shown}"
    path = write(tmp_path, f"model:\n  task:\n    doc_stride: {text}\n", "t.yaml")
    assert "model.task.doc_stride must be a finite number" in error_of(path)


@pytest.mark.parametrize("value,shown", [(".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan"),
                                         ("inf", "'inf'"), ("-inf", "'-inf'"),
                                         ("nan", "'nan'")])
def test_non_finite_in_override(value: str, shown: str) -> None:
    message = error_of("tiny", [f"optimizer.lr={value}"])
    assert message == (f"--set optimizer.lr={value}: optimizer.lr must be a finite number, "
                       f"got {shown}")


def test_non_finite_text_is_a_string_where_a_string_is_expected() -> None:
    assert load_config("tiny", ["tracking.run_name=nan"]).tracking.run_name == "nan"


def test_non_finite_in_dict_and_validate() -> None:
    with pytest.raises(ConfigError, match=r"^<dict>: model.hidden_dropout must be a finite"):
        config_from_dict({"model": {"hidden_dropout": float("nan")}})
    cfg = load_config("tiny")
    cfg.optimizer.max_grad_norm = float("inf")
    with pytest.raises(ConfigError, match="optimizer.max_grad_norm must be a finite number"):
        cfg.validate()


def test_duplicate_key_names_file_key_and_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "optimizer:\n  lr: 0.1\n  eps: 1e-6\n  lr: 0.2\ntraining:\n"
                           "  steps: 3\n")
    assert error_of(path) == f"{path}: duplicate key optimizer.lr at lines 2 and 4"
    path = write(tmp_path, "training:\n  steps: 3\nmodel:\n  num_layers: 2\ntraining:\n"
                           "  log_every: 1\n", "top.yaml")
    assert error_of(path) == f"{path}: duplicate key training at lines 1 and 5"
    path = write(tmp_path, "model:\n  task:\n    labels: [a, b]\n    name: classification\n"
                           "    labels: [c, d]\n", "deep.yaml")
    assert error_of(path) == f"{path}: duplicate key model.task.labels at lines 3 and 5"


def test_duplicate_key_in_override_and_merge_keys_allowed() -> None:
    assert error_of("tiny", ["model.task={name: squad, name: x}"]).endswith(
        "duplicate key name")
    # A key that overrides one brought in by a YAML merge (<<) is not a duplicate.
    text = "base: &b {a: 1, b: 2}\nderived:\n  <<: *b\n  a: 3\n"
    assert load_yaml(text)["derived"] == {"a": 3, "b": 2}
    with pytest.raises(DuplicateKeyError):
        load_yaml("derived:\n  <<: {a: 1}\n  a: 3\n  a: 4\n")


# ---------------------------------------------------------------------------------------------
# Task settings (model.task) and the legacy model.extra


def test_model_task_round_trip(tmp_path: Path) -> None:
    text = ("model:\n  task:\n    name: classification\n    hf_architecture: "
            "BertForSequenceClassification\n    lowercase: false\n    num_labels: 3\n"
            "    labels: [neg, neutral, pos]\n")
    cfg = load_config(write(tmp_path, text))
    assert cfg.model.task == TaskConfig(name="classification",
                                        hf_architecture="BertForSequenceClassification",
                                        lowercase=False, num_labels=3,
                                        labels=["neg", "neutral", "pos"])
    path = atomic_write_text(tmp_path / "saved.yaml", dump_config(cfg))
    assert load_config(path) == cfg
    assert config_from_dict(yaml.safe_load(path.read_text())) == cfg
    assert "  task:\n    name: classification\n" in path.read_text()


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("model:\n  task:\n    nme: squad\n",
         "unknown key model.task.nme (did you mean 'name'?); valid keys: activation, "
         "doc_stride, hf_architecture, labels, loss, lowercase, matryoshka_dims, "
         "max_query_length, name, normalize, num_labels, pooling, prompts, scale, symmetric, "
         "texts"),
        ("model:\n  task: squad\n", "model.task must be a mapping of keys, got 'squad'"),
        ("model:\n  task:\n    name: ner\n", "model.task.name must be one of squad, "
                                             "classification, token-classification, embedding "
                                             "or null, got 'ner'"),
        ("model:\n  task:\n    lowercase: 1\n", "model.task.lowercase: expected bool, got 1"),
        ("model:\n  task:\n    name: classification\n",
         "model.task.num_labels must be set for model.task.name 'classification'"),
        ("model:\n  task:\n    num_labels: 3\n    labels: [a, b]\n",
         "model.task.labels names 2 classes but model.task.num_labels is 3"),
    ],
)
def test_model_task_is_validated(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == f"{path}: {fragment}"


def test_model_task_overrides() -> None:
    assert error_of("tiny", ["model.task.nme=squad"]).startswith(
        "--set model.task.nme=squad: unknown key model.task.nme (did you mean 'name'?)")
    assert error_of("tiny", ["model.task.name.x=1"]).startswith(
        "--set model.task.name.x=1: model.task.name is not a mapping")
    assert error_of("tiny", ["model.task.name=classification"]) == (
        "--set model.task.name=classification: model.task.num_labels must be set for "
        "model.task.name 'classification'")
    cfg = load_config("tiny", ["model.task={name: classification, num_labels: 2}",
                               "model.task.lowercase=false"])
    assert cfg.model.task == TaskConfig(name="classification", num_labels=2, lowercase=False)


LEGACY_EXTRA = {"task": "squad", "hf_architecture": "BertForQuestionAnswering",
                "lowercase": False, "doc_stride": 128, "max_query_length": 64}


def test_legacy_extra_loads_as_task(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Checkpoints written before model.task hold the task settings in model.extra."""
    old = load_config("tiny").to_dict()
    del old["preset"]
    del old["model"]["task"]
    old["model"]["extra"] = dict(LEGACY_EXTRA, note="never read")
    expected = TaskConfig(name="squad", hf_architecture="BertForQuestionAnswering",
                          lowercase=False, doc_stride=128, max_query_length=64)
    with caplog.at_level(logging.INFO):
        from_dict = config_from_dict(old)
        path = write(tmp_path, yaml.safe_dump(old, sort_keys=False))
        from_file = load_config(path, ["model.task.doc_stride=96"])
    assert not caplog.records, "legacy configs load without warnings"
    assert from_dict.model.task == expected and from_dict.preset is None
    assert from_file.model.task.doc_stride == 96 and from_file.model.task.name == "squad"
    # An empty extra (what pre-training checkpoints hold) is the default task settings.
    old["model"]["extra"] = {}
    assert config_from_dict(old).model.task == TaskConfig()
    # Once re-saved, the config speaks model.task.
    assert "extra" not in dump_config(from_dict) and "task:\n" in dump_config(from_dict)


def test_legacy_extra_errors_name_model_task(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  extra:\n    num_labels: one\n")
    assert error_of(path) == f"{path}: model.task.num_labels: expected int or null, got 'one'"


# ---------------------------------------------------------------------------------------------
# The finetune section


@pytest.mark.parametrize(
    "override,expected",
    [
        ("finetune.task=ner", "finetune.task must be one of squad, classification, "
                              "token-classification, embedding or null, got 'ner'"),
        ("finetune.epochs=0", "finetune.epochs must be >= 1, got 0"),
        ("finetune.warmup_proportion=1.5", "finetune.warmup_proportion must be in [0, 1], got 1.5"),
        ("finetune.warmup_proportion=-0.1",
         "finetune.warmup_proportion must be in [0, 1], got -0.1"),
        ("finetune.max_seq_length=7", "finetune.max_seq_length must be >= 8 or null, got 7"),
        ("finetune.doc_stride=0", "finetune.doc_stride must be >= 1, got 0"),
        ("finetune.max_query_length=0", "finetune.max_query_length must be >= 1, got 0"),
        ("finetune.n_best_size=0", "finetune.n_best_size must be >= 1, got 0"),
        ("finetune.max_answer_length=0", "finetune.max_answer_length must be >= 1, got 0"),
        ("finetune.eval_batch_size=0", "finetune.eval_batch_size must be >= 1, got 0"),
        ("finetune.dropout=1.0", "finetune.dropout must be in [0, 1) or null, got 1.0"),
        ("finetune.dropout=-0.1", "finetune.dropout must be in [0, 1) or null, got -0.1"),
    ],
)
def test_finetune_keys_are_checked(override: str, expected: str) -> None:
    assert error_of("tiny", [override]) == f"--set {override}: {expected}"


def test_finetune_edges_are_allowed() -> None:
    cfg = load_config("tiny", ["finetune.max_seq_length=8", "finetune.warmup_proportion=0",
                               "finetune.dropout=0", "finetune.max_seq_length=null",
                               "finetune.warmup_proportion=1"])
    assert cfg.finetune.max_seq_length is None and cfg.finetune.warmup_proportion == 1.0
    assert cfg.finetune.dropout == 0.0 and cfg.finetune.task is None


def test_a_finetune_task_needs_its_inputs_when_the_run_starts(tmp_path: Path) -> None:
    """The finetune-* presets name a task but no inputs, so they load; the run asks for them."""
    cfg = load_config("finetune-squad")
    with pytest.raises(ConfigError) as info:
        cfg.finetune.check_inputs()
    assert str(info.value) == "finetune.checkpoint must be set for finetune.task 'squad'"
    cfg = load_config("finetune-classification", ["finetune.checkpoint=run"])
    with pytest.raises(ConfigError, match=r"^finetune.train_file must be set for "
                                          r"finetune.task 'classification'$"):
        cfg.finetune.check_inputs()
    cfg = load_config("finetune-squad", ["finetune.checkpoint=run", "finetune.train_file=t.json"])
    cfg.finetune.check_inputs()
    load_config("tiny").finetune.check_inputs()  # pre-training: no inputs needed
    assert config_from_dict(cfg.to_dict()) == cfg


def test_finetune_tasks_are_the_model_task_names() -> None:
    from popbert.builders.bert_config import TASK_NAMES
    from popbert.config.sections import FINETUNE_TASKS

    assert FINETUNE_TASKS is TASK_NAMES
    assert FINETUNE_TASKS == ("squad", "classification", "token-classification", "embedding")


# ---------------------------------------------------------------------------------------------
# One source per setting


def test_an_error_across_keys_blames_the_override_that_gave_one(tmp_path: Path) -> None:
    """A rule spanning keys names its keys; the error starts with the --set that gave one."""
    message = error_of("base-128", ["execution.micro_batch_size=48"])
    assert message.startswith("--set execution.micro_batch_size=48: training.global_batch_size "
                              "(65536) is not divisible")
    assert error_of("tiny", ["execution.pipeline=true"]).startswith(
        "--set execution.pipeline=true: execution.pipeline needs model.layers_per_ipu")
    path = write(tmp_path, "execution:\n  backend: popart\nmodel:\n  dialect: popart\n")
    assert error_of(path, ["model.dialect=onnx"]).startswith(
        "--set model.dialect=onnx: execution.backend 'popart' needs model.dialect 'popart'")
    assert error_of(write(tmp_path, "execution:\n  pipeline: true\n", "p.yaml")).startswith(
        f"{tmp_path / 'p.yaml'}: execution.pipeline needs")


def test_model_errors_carry_their_keys() -> None:
    from popbert.builders.bert_config import BertConfig
    from popbert.rules import Invalid

    with pytest.raises(Invalid) as info:
        BertConfig(hidden_size=100, num_heads=3).validate()
    assert info.value.keys == ("model.hidden_size", "model.num_heads")
    assert isinstance(info.value, ValueError)
    with pytest.raises(Invalid) as info:
        BertConfig(attention_dropout=1.0).validate()
    assert str(info.value) == "model.attention_dropout must be in [0, 1), got 1.0"
    assert info.value.keys == ("model.attention_dropout",)


def test_session_options_check_by_the_execution_rules() -> None:
    """SessionOptions has no ranges of its own: replication_factor is execution.replicas."""
    from popbert.config import ExecutionConfig
    from popbert.rules import rule_of
    from popbert.runtime.options import SessionOptions

    with pytest.raises(ValueError, match=r"^SessionOptions.replication_factor must be >= 1, "
                                         r"got 0$"):
        SessionOptions(replication_factor=0)
    with pytest.raises(ValueError, match=r"^SessionOptions.pipeline_schedule must be one of "
                                         r"1f1b, gpipe, got 'zigzag'$"):
        SessionOptions(pipeline_schedule="zigzag")
    assert rule_of(ExecutionConfig, "replicas") is not None
    options = SessionOptions.from_config(load_config("tiny", ["execution.replicas=2",
                                                              "execution.weight_dtype=float16"]))
    assert options.replication_factor == 2 and options.weight_dtype == "float16"


def test_each_choice_is_defined_once(tmp_path: Path) -> None:
    from popbert.backends import BACKENDS
    from popbert.config import sections
    from popbert.observe.tracking import MetricsLogger

    assert BACKENDS is sections.BACKENDS
    with pytest.raises(ConfigError, match=r"^tracking.backend: expected one of none, wandb, "
                                          r"got 'mlflow'$"):
        MetricsLogger(tmp_path, {}, backend="mlflow")


# ---------------------------------------------------------------------------------------------
# Through the CLI: exit status 2 and one line


@pytest.mark.parametrize(
    "text,overrides,fragment",
    [
        ("training:\n  steps: 5\n", ["optimizer.lr=inf"],
         "--set optimizer.lr=inf: optimizer.lr must be a finite number, got 'inf'"),
        ("optimizer:\n  lr: -.inf\n", [], "optimizer.lr must be a finite number, got -inf"),
        ("optimizer:\n  lr: 0.1\n  lr: 0.2\n", [], "duplicate key optimizer.lr at lines 2 and 3"),
        ("preset: huge\n", [], "preset: unknown preset 'huge'; presets: base-128"),
        ("model:\n  task:\n    stride: 3\n", [], "unknown key model.task.stride"),
    ],
)
def test_cli_config_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli_logging: None, text: str,
    overrides: list[str], fragment: str,
) -> None:
    from popbert.cli.main import main

    path = write(tmp_path, text)
    argv = ["config", "--config", str(path)]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("popbert: error: ")
    assert fragment in lines[0]
    if not overrides:
        assert lines[0].startswith(f"popbert: error: {path}: ")


def test_cli_config_prints_a_partial_file_over_its_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli_logging: None
) -> None:
    from popbert.cli.main import main

    path = write(tmp_path, "training:\n  steps: 10\n")
    assert main(["config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("preset: tiny\nmodel:\n  vocab_size: 8192\n")
    assert load_config(write(tmp_path, out, "resolved.yaml")) == load_config(path)


@pytest.mark.parametrize(("text", "seconds"), [("600", 600.0), ("90s", 90.0), ("30m", 1800.0),
                                               ("2h", 7200.0), ("1h30m", 5400.0),
                                               ("1.5h", 5400.0), ("null", None)])
def test_a_time_budget_takes_durations(text: str, seconds: float | None) -> None:
    assert load_config("tiny", [f"training.time_budget={text}"]).training.time_budget == seconds


@pytest.mark.parametrize(("text", "fragment"), [
    ("ten", "training.time_budget: expected seconds (a number, or e.g. 90s, 30m, 2h) or null"),
    ("30x", "expected seconds"), ("0", "training.time_budget must be > 0 or null"),
    ("-5m", "expected seconds")])
def test_a_bad_time_budget_is_one_line(text: str, fragment: str) -> None:
    message = error_of("tiny", [f"training.time_budget={text}"])
    assert message.startswith(f"--set training.time_budget={text}: ") and fragment in message


def test_eval_points_need_a_budget_and_dynamic_masking_unpacked_rows() -> None:
    assert load_config("fast").training.eval_points == 10
    message = error_of("tiny", ["training.eval_points=4"])
    assert "training.eval_points" in message and "training.time_budget" in message
    assert load_config("tiny", ["training.eval_points=4", "training.time_budget=5m"])
    message = error_of("tiny", ["data.dynamic_masking=true", "model.packed=true"])
    assert "data.dynamic_masking" in message
    message = error_of("tiny", ["model.next_sentence_prediction=false", "model.packed=true"])
    assert "model.packed packs sentence pairs" in message


def test_the_fast_preset_takes_the_documented_overrides() -> None:
    """The issue's interface: a budget in seconds, text files for training and validation."""
    cfg = load_config("fast", ["training.time_budget=600", "data.input_files=[train.txt]",
                               "data.validation_files=[heldout.txt]"])
    assert cfg.training.time_budget == 600 and cfg.data.input_files == ["train.txt"]
    assert cfg.data.validation_files == ["heldout.txt"] and cfg.data.validation_fraction == 0
    assert not cfg.model.next_sentence_prediction and cfg.data.dynamic_masking
