"""A pytest plugin (``pytest_plugins = ("tests.support.http_fixture",)``): one runtime serving HTTP,
shared by every module that loads it (test_http_api and test_http_stream): ``server`` (it), its
``client`` (the ``openai`` package's) and the model's tokenizer ``tok``."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.support.http_server import start_http_runtime


@pytest.fixture(scope="session")
def http_runtime(tiny_model, tmp_path_factory):
    flags = ("--num-blocks", "2048", "--chunk-cap", "64")
    with start_http_runtime(tiny_model, tmp_path_factory.mktemp("http"), *flags) as h:
        yield h


@pytest.fixture(scope="module")
def server(http_runtime):
    return http_runtime


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def client(server):
    return server.client()
