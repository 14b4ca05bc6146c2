import json
from pathlib import Path

import pytest

from moe_ref.core.config import PRESETS, MoEConfig, ParallelConfig, hf_config_dict, preset
from moe_ref.core.errors import (ExpertsNotDivisibleError, GroupConfigError, InvalidConfigError, TopKError,
                                 TPExceedsExpertsError, UnknownNameError)

pytestmark = pytest.mark.unit
MODELS = Path(__file__).resolve().parents[2] / "moe_ref" / "core" / "presets"


def test_kimi_k2_fields_from_real_config():
    cfg = MoEConfig.from_hf_config(MODELS / "kimi-k2.json")
    assert (cfg.num_experts, cfg.num_topk, cfg.hidden_size, cfg.intermediate_size) == (384, 8, 7168, 2048)
    assert (cfg.scoring, cfg.use_selection_bias, cfg.renormalize) == ("sigmoid", True, True)
    assert cfg.routed_scaling_factor == pytest.approx(2.827)
    assert (cfg.num_shared_experts, cfg.shared_intermediate_size, cfg.family) == (1, 2048, "kimi_k2")
    assert cfg.moe_layers[0] == 1 and len(cfg.moe_layers) == 60


def test_deepseek_v3_groups():
    cfg = MoEConfig.from_hf_config(MODELS / "deepseek-v3.json")
    assert (cfg.num_experts, cfg.num_groups, cfg.num_topk_groups, cfg.routed_scaling_factor) == (256, 8, 4, 2.5)
    assert cfg.moe_layers[0] == 3


def test_kimi_k3_latent_situ_from_text_config():
    cfg = MoEConfig.from_hf_config(MODELS / "kimi-k3.json")
    assert (cfg.num_experts, cfg.num_topk, cfg.latent_dim, cfg.expert_hidden_size) == (896, 16, 3584, 3584)
    assert (cfg.activation, cfg.situ_beta, cfg.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert (cfg.num_shared_experts, cfg.shared_intermediate_size, cfg.rms_norm_eps) == (2, 6144, 1e-5)
    assert cfg.family == "kimi_k3" and cfg.use_selection_bias


def test_step3_softmax_no_renorm_fused_shared():
    cfg = MoEConfig.from_hf_config(MODELS / "step3.json")
    assert (cfg.num_experts, cfg.num_topk, cfg.intermediate_size) == (48, 3, 5120)
    assert (cfg.scoring, cfg.renormalize, cfg.use_selection_bias) == ("softmax", False, False)
    assert (cfg.num_shared_experts, cfg.shared_intermediate_size) == (1, 5120)
    assert cfg.moe_layers == tuple(range(4, 60)) and not cfg.is_moe_layer(3) and cfg.is_moe_layer(4)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_round_trip_through_hf_dict(name):
    cfg = preset(name)
    back = MoEConfig.from_hf_config(hf_config_dict(cfg))
    for field in ("num_experts", "num_topk", "hidden_size", "intermediate_size", "scoring", "use_selection_bias",
                  "renormalize", "num_groups", "num_topk_groups", "activation", "num_shared_experts",
                  "shared_intermediate_size", "latent_dim", "family"):
        assert getattr(back, field) == getattr(cfg, field), f"{name=} {field=}"
    assert back.routed_scaling_factor == pytest.approx(cfg.routed_scaling_factor)


def test_config_path_can_be_folder(tmp_path):
    (tmp_path / "config.json").write_text((MODELS / "kimi-k2.json").read_text())
    assert MoEConfig.from_hf_config(tmp_path).num_experts == 384


def test_missing_file_and_non_moe_config(tmp_path):
    with pytest.raises(InvalidConfigError, match="does not exist"):
        MoEConfig.from_hf_config(tmp_path / "nope.json")
    with pytest.raises(InvalidConfigError, match="is it an MoE model"):
        MoEConfig.from_hf_config({"hidden_size": 64, "model_type": "llama"})


def test_step3_tp64_names_both_numbers():
    problems = ParallelConfig(tp_size=64).problems(preset("step3"))
    assert len(problems) == 1 and isinstance(problems[0], TPExceedsExpertsError)
    message = str(problems[0])
    assert "64" in message and "48" in message and "CFG001" in message and "ep_size/dp_size" in message


def test_experts_not_divisible_lists_valid_sizes():
    (problem,) = ParallelConfig(ep_size=5).problems(preset("kimi-k2"))
    assert isinstance(problem, ExpertsNotDivisibleError) and "384" in str(problem) and "8" in str(problem)
    with pytest.raises(ExpertsNotDivisibleError):
        ParallelConfig(ep_size=5).num_local_experts(preset("kimi-k2"))
    assert isinstance(problem, ValueError)  # callers' `except ValueError` keeps working


@pytest.mark.parametrize("overrides, error, needle", [
    (dict(num_topk=17), TopKError, "num_topk=17 > num_experts=16"),
    (dict(num_groups=3, num_topk_groups=1), GroupConfigError, "num_groups=3 does not divide num_experts=16"),
    (dict(num_groups=4, num_topk_groups=5), GroupConfigError, "num_topk_groups=5 > num_groups=4"),
    (dict(num_groups=8, num_topk_groups=1), GroupConfigError, "hold 2 experts, fewer than num_topk=4"),
    (dict(scoring="tanh"), UnknownNameError, "scoring='tanh'"),
    (dict(activation="gelu"), UnknownNameError, "activation='gelu'"),
    (dict(hidden_size=0), InvalidConfigError, "hidden_size=0"),
])
def test_bad_model_config_errors(overrides, error, needle):
    base = dict(num_experts=16, num_topk=4, hidden_size=48, intermediate_size=40)
    with pytest.raises(error, match=needle.replace("(", r"\(").replace(")", r"\)")):
        MoEConfig(**{**base, **overrides})


def test_unchecked_collects_every_problem():
    cfg = MoEConfig.unchecked(num_experts=16, num_topk=20, hidden_size=8, intermediate_size=8, scoring="x",
                              activation="y")
    codes = [p.code for p in cfg.problems()]
    assert codes == ["CFG006", "CFG006", "CFG003"]


def test_cfg_from_json_string_keys_ignore_extra(tmp_path):
    raw = json.loads((MODELS / "deepseek-v3.json").read_text())
    raw["some_future_field"] = 1
    assert MoEConfig.from_hf_config(raw).num_experts == 256


@pytest.mark.parametrize("raw", [
    dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
    dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
         shared_expert_intermediate_size=24),
    dict(model_type="deepseek_v2", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
         topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=16.0),
    dict(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, swiglu_limit=3.0),
    dict(model_type="ernie4_5_moe", moe_num_experts=8, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1),
    dict(model_type="hunyuan_v1_moe", num_experts=8, moe_topk=[2, 2], intermediate_size=16),
    dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=16),
    dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, intermediate_size=16),
    dict(model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2,
         topk_group=1),
], ids=lambda raw: raw["model_type"])
def test_every_family_round_trips_through_its_hf_dict(raw):
    cfg = MoEConfig.from_hf_config({**raw, "hidden_size": 32, "num_hidden_layers": 1})
    back = MoEConfig.from_hf_config(hf_config_dict(cfg))
    assert back == cfg, (cfg, back)
    assert back.family == raw["model_type"] and back.moe_layers == (0,)
