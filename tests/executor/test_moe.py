"""Qwen3-MoE on the native path (gpu/model/experts.py): the router's top-k and each expert run
over the step's rows together, token for token with transformers' ``generate``; sparse and
dense layers mixed (``mlp_only_layers``, ``decoder_sparse_step``) as transformers builds them."""

from __future__ import annotations

import pytest

from gpu.model.families import FAMILIES
from gpu.model.loader import load_spec
from gpu.model.make_model import make_model
from tests.executor.test_transformers_path import _exact, _runner

VARIANTS = {
    "every_layer_sparse": {},
    "dense_first_layer": {"mlp_only_layers": [0], "num_hidden_layers": 3},
    "every_second_layer": {"decoder_sparse_step": 2, "num_hidden_layers": 3},
    "no_renormalization": {"norm_topk_prob": False, "num_experts_per_tok": 3},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_native_moe_matches_transformers(tmp_path, name):
    model_dir = make_model("qwen3_moe", "tiny", tmp_path / name, config_overrides=VARIANTS[name])
    ex = _runner(model_dir, model_impl="native")
    spec = ex.spec
    assert spec.impl == "native" and spec.experts == FAMILIES["qwen3_moe"]["num_experts"]
    sparse = {
        "every_layer_sparse": (0, 1),
        "dense_first_layer": (1, 2),
        "every_second_layer": (1,),
        "no_renormalization": (0, 1),
    }[name]
    assert spec.moe_layers == sparse
    _exact(model_dir, ex)


def test_auto_serves_qwen3_moe_natively(tmp_path):
    model_dir = make_model("qwen3_moe", "tiny", tmp_path / "m")
    assert load_spec(model_dir).impl == "native"
    with pytest.raises(ValueError, match=r"--enable-lora is not supported with mixture-of"):
        _runner(model_dir, max_loras=2)
