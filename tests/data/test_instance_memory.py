"""Instances that cannot fit in memory are refused before any is made, on both data roads (the
kernel would otherwise kill the process mid-stage, or another process of the machine, with no
word of why): one line naming the part, the dupe factor and the memory there is."""

from __future__ import annotations

from pathlib import Path

import pytest

from popbert.cli import main as cli
from popbert.data import instances
from popbert.data.errors import DataError
from popbert.data.instances import InstanceOptions, check_instance_memory, least_instance_bytes
from popbert.data.tokenization import bundled_vocab_path

HUGE_DUPE = 2_000_000_000  # terabytes of instances for a few sentences


def test_the_floor_is_under_what_the_arrays_take() -> None:
    """The estimate is a floor: below the finished arrays' own bytes times the least peak
    factor measured, for rows that hold the most tokens they can."""
    options = InstanceOptions(sequence_length=128, max_predictions_per_seq=20, dupe_factor=3)
    rows = 3 * 100  # 100 full rows of 125 text tokens per pass
    finished = rows * 4 * (3 * 128 + 2 * 20 + 1)
    assert least_instance_bytes(100 * 125, options) == instances.PEAK_OVER_LEAST * finished
    assert instances.PEAK_OVER_LEAST < 4.7  # the least peak over finished arrays measured


def test_the_check_refuses_only_what_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    options = InstanceOptions(sequence_length=128, max_predictions_per_seq=20, dupe_factor=5)
    need = least_instance_bytes(10_000, options)
    monkeypatch.setattr(instances, "available_memory", lambda: need - 1)
    with pytest.raises(DataError, match=r"10,000 tokens at dupe factor 5 .* GiB available"):
        check_instance_memory(10_000, options)
    monkeypatch.setattr(instances, "available_memory", lambda: need)
    check_instance_memory(10_000, options)
    monkeypatch.setattr(instances, "available_memory", lambda: None)  # not known: no check
    check_instance_memory(10_000, options)


def test_both_roads_say_it_in_one_line_and_leave_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("One sentence of a document. Another one follows it.\n"
                      "A second line of the same document.\n\nA second document.\n")
    out = tmp_path / "inst"
    capsys.readouterr()
    assert cli.main(["prepare-data", "instances", "--input", str(corpus), "--vocab",
                     str(bundled_vocab_path()), "-o", str(out), "--sequence-length", "32",
                     "--max-predictions", "5", "-j", "1", "--dupe-factor", str(HUGE_DUPE)]) == 2
    lines = errors(capsys)
    assert "corpus.txt" in lines[0] and f"dupe factor {HUGE_DUPE}" in lines[0], lines[0]
    assert "GiB available: lower the dupe factor" in lines[0]
    assert not list(out.glob("**/*.h5"))
    # the text road: pretraining straight from the text corpus
    run = tmp_path / "run"
    assert cli.main(["pretrain", "--set", f"data.duplication_factor={HUGE_DUPE}", "--set",
                     f"data.input_files=[{corpus}]", "-o", str(run)]) == 2
    lines = errors(capsys)
    assert f"dupe factor {HUGE_DUPE}" in lines[0], lines
    assert not run.exists()


def errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The one `popbert: error:` line on stderr, last, with no traceback (log lines before it
    say what the command was doing)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("popbert: error: ")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]) and "Traceback" not in err, err
    return lines
