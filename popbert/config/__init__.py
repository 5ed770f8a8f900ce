"""Run configuration: one YAML file, laid over a preset, into validated dataclasses.

`sections` holds the dataclasses (one per YAML section) and the checks a whole config passes;
`loading` reads files, presets and `--set` overrides and writes the resolved config back;
`yaml_io` is the YAML dialect both use. Import the names from here.
"""

from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.config.loading import (
    DEFAULT_PRESET,
    PRESETS_DIR,
    apply_overrides,
    config_from_dict,
    dump_config,
    list_presets,
    load_config,
    parse_override,
    preset_path,
)
from popbert.config.sections import (
    SECTIONS,
    DataConfig,
    ExecutionConfig,
    FinetuneConfig,
    OptimizerConfig,
    RunConfig,
    TrackingConfig,
    TrainingConfig,
    parse_lr_schedule,
    warn_config,
)
from popbert.errors import ConfigError

__all__ = [
    "DEFAULT_PRESET", "PRESETS_DIR", "SECTIONS", "BertConfig", "ConfigError", "DataConfig",
    "ExecutionConfig", "FinetuneConfig", "OptimizerConfig", "RunConfig", "TaskConfig",
    "TrackingConfig", "TrainingConfig", "apply_overrides", "config_from_dict", "dump_config",
    "list_presets", "load_config", "parse_lr_schedule", "parse_override", "preset_path",
    "warn_config",
]
