"""Every family's Hugging Face facts come from the family table: `Family.hf_*` (plain names),
each task's classes (`popbert.tasks.TASKS`) and one entry of code per family
(`popbert.hf.mapping.HF_FAMILIES`). Nothing in `popbert/hf/*.py` branches on a family's
name, and `export-hf --architecture` offers every family's classes."""

from __future__ import annotations

import re
from pathlib import Path

from popbert.builders.bert_config import BertConfig
from popbert.builders.families import FAMILIES
from popbert.cli.main import build_parser
from popbert.hf import mapping as hf
from popbert.tasks import TASKS

ROOT = Path(__file__).resolve().parents[2]


def test_each_familys_classes_are_its_base_pretraining_and_task_classes() -> None:
    for family in FAMILIES.values():
        if family.hf_model_type is None:  # transformers has no such model (GroupBERT)
            assert not hf.architectures_of(family.name) and family.name not in hf.HF_FAMILIES
            continue
        tasks = [task.hf_architecture(family.name) for task in TASKS.values()]
        assert None not in tasks, family.name
        # an embedding model is the bare encoder: the base class, which holds no head
        heads = [name for name in tasks if name != family.hf_base]
        assert sorted(hf.architectures_of(family.name)) == sorted(
            [family.hf_base, *family.hf_pretraining, *heads]), family.name
        assert hf.architectures_by_heads(family.name) == [*heads, *family.hf_pretraining]
        assert family.name in hf.HF_FAMILIES and family.hf_tokenizers
    assert {spec.family for spec in hf.ARCHITECTURES.values()} == set(hf.HF_FAMILIES)


def test_config_json_fields_round_trip_through_the_familys_table() -> None:
    """Each family's `hf_config_fields` are written and read back to the same values."""
    for family in FAMILIES.values():
        if family.name not in hf.HF_FAMILIES:
            continue
        code = hf.HF_FAMILIES[family.name]
        config = code.config_from_hf({"model_type": family.hf_model_type}, "config.json")
        config.hidden_dropout = 0.25
        written = code.config_to_hf(config, str(family.hf_base),
                                    {"[PAD]": 0, "[CLS]": 2, "[SEP]": 3})
        assert written["model_type"] == family.hf_model_type
        assert hf.hf_family(written, "config.json") is family
        back = hf.config_from_hf(written, "config.json", config.sequence_length)
        assert back == config, family.name
        for key, _ in family.hf_config_fields:
            assert key in written, (family.name, key)
    assert hf.hf_family({}, "config.json").name == BertConfig().architecture


def test_no_hf_module_branches_on_a_family_name() -> None:
    names = "|".join(re.escape(name) for name in FAMILIES)
    branch = re.compile(rf"""[!=]=\s*["']({names})["']|["']({names})["']\s*[!=]=""")
    for path in sorted((ROOT / "popbert" / "hf").glob("*.py")):
        hits = [line for line in path.read_text().splitlines() if branch.search(line)]
        assert not hits, (path.name, hits)


def test_export_hf_help_names_every_familys_classes() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    action = next(a for a in sub.choices["export-hf"]._actions if a.dest == "architecture")
    assert action.choices is None  # checked against the checkpoint's family once it is read
    assert set(re.findall(r"\w+", action.help)) >= set(hf.ARCHITECTURES)
