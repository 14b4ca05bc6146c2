"""Bad model config files get coded errors naming the file, the key and the fix (no bare errors)."""
from __future__ import annotations

import json

import pytest

from moe_ref.core.config import MoEConfig, preset
from moe_ref.core.errors import ConfigFieldError, ConfigFileError, InvalidConfigError

pytestmark = pytest.mark.unit

KIMI_K2 = {"model_type": "kimi_k2", "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 384,
           "num_experts_per_tok": 8, "n_shared_experts": 1, "scoring_func": "sigmoid", "norm_topk_prob": True,
           "routed_scaling_factor": 2.827, "num_hidden_layers": 61, "first_k_dense_replace": 1, "hidden_act": "silu"}


def _write(tmp_path, content) -> str:
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_the_good_file_loads(tmp_path):
    cfg = MoEConfig.from_hf_config(_write(tmp_path, KIMI_K2))
    assert (cfg.num_experts, cfg.hidden_size, cfg.moe_layers[:2]) == (384, 7168, (1, 2))


@pytest.mark.parametrize("edit,needle", [
    (lambda c: {**c, "hidden_size": None}, "'hidden_size' is null"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "'hidden_size' is missing"),
    (lambda c: {k: v for k, v in c.items() if k != "moe_intermediate_size"}, "'moe_intermediate_size' is missing"),
    (lambda c: {**c, "hidden_size": "7168"}, "'hidden_size' is \"7168\" \\(str\\); it must be a JSON integer"),
    (lambda c: {**c, "hidden_size": 7168.5}, "'hidden_size' is 7168.5 \\(float\\)"),
    (lambda c: {**c, "n_routed_experts": True}, "'n_routed_experts' is true \\(bool\\)"),
    (lambda c: {**c, "norm_topk_prob": "yes"}, "'norm_topk_prob' is \"yes\" \\(str\\); it must be true or false"),
    (lambda c: {**c, "routed_scaling_factor": "2.8"}, "'routed_scaling_factor' .* must be a JSON number"),
    (lambda c: {**c, "hidden_act": 3}, "'hidden_act' is 3 \\(int\\); it must be a JSON string"),
    (lambda c: {**c, "num_experts_per_tok": None}, "'num_experts_per_tok' is null"),
])
def test_bad_field_is_cfg011_naming_file_and_key(tmp_path, edit, needle):
    path = _write(tmp_path, edit(KIMI_K2))
    with pytest.raises(ConfigFieldError, match=needle) as info:
        MoEConfig.from_hf_config(path)
    assert info.value.code == "CFG011" and path in str(info.value) and "fix it in the file" in str(info.value)
    assert isinstance(info.value, InvalidConfigError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("content,needle", [
    ("{\"hidden_size\": 7168,", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("\xff\xfe", "is not valid JSON"),
    ("[1, 2, 3]", "holds a JSON list, not an object"),
    ("7168", "holds a JSON int, not an object"),
])
def test_unreadable_file_is_cfg010_naming_the_file(tmp_path, content, needle):
    path = _write(tmp_path, content)
    with pytest.raises(ConfigFileError, match=needle) as info:
        MoEConfig.from_hf_config(path)
    assert info.value.code == "CFG010" and path in str(info.value)


@pytest.mark.parametrize("arg", [None, 7168, ["config.json"]])
def test_a_non_path_argument_is_cfg010(arg):
    with pytest.raises(ConfigFileError, match="pass a MoEConfig, a preset name, the path of config.json") as info:
        MoEConfig.from_hf_config(arg)
    assert info.value.code == "CFG010"


def test_missing_file_and_folder_without_config(tmp_path):
    with pytest.raises(ConfigFileError, match="does not exist"):
        MoEConfig.from_hf_config(tmp_path / "nope.json")
    with pytest.raises(ConfigFileError, match=r"config\.json' does not exist"):
        MoEConfig.from_hf_config(tmp_path)


def test_megamoe_reports_the_same_coded_errors(tmp_path):
    from moe_ref import MegaMoE

    with pytest.raises(InvalidConfigError) as info:  # the layer's own check (CFG007) or the file reader's
        MegaMoE(None)
    assert info.value.code in ("CFG007", "CFG010") and "NoneType" in str(info.value)
    with pytest.raises(ConfigFieldError, match="'hidden_size' is null"):
        MegaMoE(_write(tmp_path, {**KIMI_K2, "hidden_size": None}))


def test_presets_still_parse():
    assert preset("kimi-k3").latent_dim == 3584 and preset("step3").moe_layers[0] == 4


# --- families: unknown, unsupported features, PretrainedConfig objects -------------------------------------------------

def test_a_missing_required_field_gives_no_made_up_example(tmp_path):
    path = _write(tmp_path, {k: v for k, v in KIMI_K2.items() if k != "num_experts_per_tok"})
    with pytest.raises(ConfigFieldError, match="'num_experts_per_tok' is missing") as info:
        MoEConfig.from_hf_config(path)
    message = str(info.value)
    assert "7168" not in message and "\"num_experts_per_tok\": the model's value" in message


def test_an_unknown_family_lists_the_model_types_and_how_to_add_one():
    from moe_ref.core.errors import UnknownFamilyError
    from moe_ref.core.families import supported_model_types

    with pytest.raises(UnknownFamilyError, match="model_type 'dbrx'") as info:
        MoEConfig.from_hf_config({"model_type": "dbrx", "hidden_size": 64, "num_experts": 8})
    message = str(info.value)
    assert info.value.code == "CFG018" and all(t in message for t in supported_model_types())
    assert "moe_ref/core/families/<family>.py" in message and "is it an MoE model" not in message
    with pytest.raises(UnknownFamilyError, match="is it an MoE model"):
        MoEConfig.from_hf_config({"model_type": "llama", "hidden_size": 64})


@pytest.mark.parametrize("edit,needle", [
    ({"mlp_bias": True}, "'mlp_bias' is true: DeepSeek-V2.* with biases on every MLP's Linear layers"),
    ({"topk_method": "sinkhorn"}, "'topk_method' is \"sinkhorn\"; DeepSeek-V2.* routes with noaux_tc, "
                                  "group_limited_greedy, greedy"),
])
def test_a_feature_the_family_math_lacks_is_cfg025(tmp_path, edit, needle):
    from moe_ref.core.errors import UnsupportedFamilyFeatureError

    v2 = {"model_type": "deepseek_v2", "hidden_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32, "mlp_bias": False}
    with pytest.raises(UnsupportedFamilyFeatureError, match=needle) as info:
        MoEConfig.from_hf_config(_write(tmp_path, {**v2, **edit}))
    assert info.value.code == "CFG025" and isinstance(info.value, InvalidConfigError)
    assert MoEConfig.from_hf_config(v2).family == "deepseek_v2"


def test_a_transformers_config_object_reads_as_its_config_json(tmp_path):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    config.save_pretrained(tmp_path)
    cfg = MoEConfig.from_hf_config(config)
    assert cfg == MoEConfig.from_hf_config(tmp_path)
    assert (cfg.family, cfg.num_experts, cfg.moe_layers, cfg.renormalize) == ("qwen3_moe", 8, (0, 2), True)
    with pytest.raises(ConfigFileError) as info:  # another object: a short message, not its whole repr
        MoEConfig.from_hf_config(object())
    assert len(str(info.value)) < 400
