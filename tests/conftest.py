"""Test-session setup: a private cache so tests never read or write the user's ~/.cache."""

from __future__ import annotations

import logging
import os

import pytest
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
