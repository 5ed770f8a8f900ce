"""Test-session setup: a private cache so tests never read or write the user's ~/.cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["POPBERT_CACHE_DIR"] = str(tmp_path_factory.mktemp("popbert-cache"))
    os.environ.setdefault("WANDB_MODE", "disabled")
