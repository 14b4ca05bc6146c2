"""Model families as data (``moe_ref.core.families``) against each family's transformers modules (fp32, CPU).

Per family: a tiny random transformers model built from the family's own configuration class (seed 0, every MoE
block's parameters redrawn O(1)), written with ``save_pretrained``; then, per MoE layer, the HF block against
``MegaMoE`` built from the saved config.json and loaded with ``load_hf_weights``, against the single-process oracle
(``reference_moe`` over ``load_moe_weights``), and the HF router against ``block.route``. One helper serves every
family: a family is a row of ``CASES``. Also checked: the registry itself, and that the MoE layers the config's rule
names are exactly the layers where transformers builds its sparse block.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

# transformers is a test dependency: imported plainly so that a missing install fails instead of skipping
import transformers
from transformers.utils import logging as hf_logging

from moe_ref.block import route
from moe_ref.checkpoint.loading import load_moe_weights
from moe_ref.core.config import MoEConfig
from moe_ref.core.families import FAMILIES, family_for_model_type, family_named, supported_model_types
from moe_ref.layer import MegaMoE
from moe_ref.reference import reference_moe

pytestmark = pytest.mark.unit

NUM_TOKENS = 48
REL_TOLERANCE = 1e-5  # max |moe_ref - HF| / max |HF|, fp32
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


@dataclass(frozen=True)
class Case:
    """One family's tiny model: its configuration class, the fields set, and the class of its sparse MoE block."""

    id: str
    config_class: str
    fields: dict[str, Any]
    block_class: str
    extra: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("deepseek_v3", "DeepseekV3Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, **MLA), "DeepseekV3MoE"),
    Case("glm4_moe", "Glm4MoeConfig", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=1.5, head_dim=16), "Glm4MoeMoE"),
    Case("deepseek_v2_greedy", "DeepseekV2Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        routed_scaling_factor=1.5, **MLA), "DeepseekV2Moe"),
    # one kept group of two experts for two slots: with K kept groups the max rule could never drop a top-K expert
    Case("deepseek_v2_group_limited_greedy", "DeepseekV2Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=0,
        topk_method="group_limited_greedy", n_group=4, topk_group=1, **MLA), "DeepseekV2Moe"),
    Case("qwen3_moe", "Qwen3MoeConfig", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
        head_dim=16), "Qwen3MoeSparseMoeBlock"),
    Case("qwen2_moe", "Qwen2MoeConfig", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
        "Qwen2MoeSparseMoeBlock"),
    Case("mixtral", "MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                          head_dim=16), "MixtralSparseMoeBlock"),
    # swiglu_limit 0.5 so that the clamps bite (pre-activations are O(1))
    Case("gpt_oss", "GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                         head_dim=16, swiglu_limit=0.5), "GptOssMLP"),
    Case("olmoe", "OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
         "OlmoeSparseMoeBlock"),
    Case("ernie4_5_moe", "Ernie4_5_MoeConfig", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                                                    moe_num_shared_experts=1, moe_layer_start_index=1),
         "Ernie4_5_MoeSparseMoeBlock"),
    Case("hunyuan_v1_moe", "HunYuanMoEV1Config", dict(num_experts=8, moe_topk=2, intermediate_size=32, head_dim=16),
         "HunYuanMoEV1Moe"),
]


def _random_(tensor: torch.Tensor, gen: torch.Generator, name: str) -> None:
    """Redraw one parameter or buffer in place: O(1) activations, a selection bias of 0.1 * U(0, 1)."""
    if name.endswith("e_score_correction_bias"):
        tensor.copy_(0.1 * torch.rand(tensor.shape, generator=gen))
    else:
        tensor.copy_(torch.randn(tensor.shape, generator=gen) / max(tensor.shape[-1], 1) ** 0.5)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """``case.id -> (folder written by save_pretrained, the HF model)``, built on first use of a case."""
    built: dict[str, tuple] = {}

    def build(case: Case):
        if case.id not in built:
            torch.manual_seed(0)
            config = getattr(transformers, case.config_class)(**{**SMALL, **case.fields})
            model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for decoder_layer in model.model.layers:
                    if type(decoder_layer.mlp).__name__ == case.block_class:
                        for name, tensor in [*decoder_layer.mlp.named_parameters(), *decoder_layer.mlp.named_buffers()]:
                            _random_(tensor, gen, name)
            folder = tmp_path_factory.mktemp(case.id)
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # tiny vocabularies draw warnings about special token ids
            try:
                model.save_pretrained(folder)
            finally:
                hf_logging.set_verbosity(verbosity)
            built[case.id] = folder, model
        return built[case.id]

    return build


def hf_block_output(block: torch.nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    """The HF sparse block on ``x_TD`` (as one sequence; gpt-oss's MLP returns (output, router scores))."""
    with torch.no_grad():
        out = block(x_TD[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def assert_relative_close(actual: torch.Tensor, expected: torch.Tensor, **case) -> None:
    assert expected.abs().max() > 0.1, f"degenerate case: the HF output is ~0; {case}"
    error = float((actual - expected).abs().max() / expected.abs().max())
    assert error <= REL_TOLERANCE, f"max relative error {error:.3g} > {REL_TOLERANCE}; {case}"


def moe_layers_of(model, case: Case) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if type(layer.mlp).__name__ == case.block_class]


def inputs(seed: int, hidden: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, hidden, generator=torch.Generator().manual_seed(seed))


# --- the registry --------------------------------------------------------------------------------------------

def test_each_model_type_belongs_to_one_family_and_names_are_unique():
    model_types = supported_model_types()
    assert len(model_types) == len(set(model_types)), model_types
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        assert family_named(family.name) is family
        for model_type in family.model_types:
            assert family_for_model_type(model_type) is family, model_type
    assert family_for_model_type("llama") is None and family_named("custom") is None


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_layout_names_its_experts_in_its_form(family):
    assert family.layouts and family.layouts[0].name == "hub", family.name
    for layout in family.layouts:
        per_expert = layout.experts == "per_expert"
        assert layout.experts in ("per_expert", "stacked", "stacked_gate_up"), layout
        assert (layout.gate_up is not None) == (layout.experts == "stacked_gate_up"), layout
        for name in (layout.gate, layout.up, layout.down):
            assert name is None or ("{expert}" in name) == per_expert, (family.name, layout.name, name)
        assert (layout.shared_gate is not None) == (family.shared.count != 0), (family.name, layout.name)
        assert (layout.router_bias is not None) == family.router.router_bias
        assert (layout.gate_up_bias is not None) == family.experts.bias
        assert (layout.shared_expert_gate is not None) == family.shared.gate


def test_every_family_with_a_transformers_module_has_a_case():
    """Kimi-K2 shares DeepSeek-V3's record (transformers has no kimi_k2 module); Kimi-K3 and Step3 have no
    transformers modules (tests/unit/test_k3_oracle.py and test_published_layouts.py cover them)."""
    covered = {family_for_model_type(c.id.split("_greedy")[0].removesuffix("_group_limited")).name for c in CASES}
    assert covered == {f.name for f in FAMILIES} - {"kimi_k2", "kimi_k3", "step3"}


# --- the config's MoE-layer rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_config_names_the_layers_transformers_builds_as_moe(case, saved_models):
    folder, model = saved_models(case)
    cfg = MoEConfig.from_hf_config(folder)
    assert list(cfg.moe_layers) == moe_layers_of(model, case), case.id
    assert MoEConfig.from_hf_config(model.config) == cfg  # a PretrainedConfig reads as its config.json


# --- the router alone ------------------------------------------------------------------------------------------

def by_expert_id(ids_TK: torch.Tensor, weights_TK: torch.Tensor):
    """Slots sorted by expert id, so two routers compare as sets (HF's top-k order is not always sorted)."""
    order_TK = ids_TK.argsort(dim=-1)
    return ids_TK.gather(1, order_TK), weights_TK.gather(1, order_TK)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_router_matches_the_transformers_router(case, saved_models):
    folder, model = saved_models(case)
    cfg = MoEConfig.from_hf_config(folder)
    layer = moe_layers_of(model, case)[-1]
    block = model.model.layers[layer].mlp
    hf_router = block.router if case.id == "gpt_oss" else block.gate
    weights = load_moe_weights(folder, cfg, layer)
    x_TD = inputs(1, cfg.hidden_size)
    with torch.no_grad():
        _, hf_weights_TK, hf_ids_TK = hf_router(x_TD)
    ids_TK, weights_TK = by_expert_id(*route(x_TD, weights.gate_weight_ED, cfg, weights.bias_E,
                                             router_bias_E=weights.router_bias_E))
    hf_ids_TK, hf_weights_TK = by_expert_id(hf_ids_TK.long(), hf_weights_TK.float())
    mismatch = (ids_TK != hf_ids_TK).any(dim=1).nonzero().flatten()
    assert mismatch.numel() == 0, f"expert sets differ for tokens {mismatch[:8].tolist()}; {case.id}"
    error = float((weights_TK - hf_weights_TK).abs().max() / hf_weights_TK.abs().max())
    assert error <= REL_TOLERANCE, f"routing weights: max relative error {error:.3g}; {case.id}"


# --- the whole block: the oracle and the layer ---------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_block_loaded_from_save_pretrained_matches_transformers(case, saved_models):
    folder, model = saved_models(case)
    cfg = MoEConfig.from_hf_config(folder)
    for layer in moe_layers_of(model, case):
        x_TD = inputs(2 + layer, cfg.hidden_size)
        expected_TD = hf_block_output(model.model.layers[layer].mlp, x_TD)
        actual_TD = reference_moe(x_TD, load_moe_weights(folder, cfg, layer), cfg)
        assert_relative_close(actual_TD, expected_TD, family=case.id, layer=layer, path="reference_moe")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_mega_moe_built_from_save_pretrained_matches_transformers(case, saved_models):
    folder, model = saved_models(case)
    for layer in moe_layers_of(model, case):
        moe = MegaMoE(folder, num_max_tokens_per_rank=NUM_TOKENS, dtype=torch.float32)
        try:
            moe.load_hf_weights(folder, layer_idx=layer)
            x_TD = inputs(2 + layer, moe.cfg.hidden_size)
            with torch.no_grad():
                actual_TD = moe(x_TD)
        finally:
            moe.destroy()
        expected_TD = hf_block_output(model.model.layers[layer].mlp, x_TD)
        assert_relative_close(actual_TD, expected_TD, family=case.id, layer=layer, path="MegaMoE")


# --- what each rule changes: the cases above would pass without it if it were a no-op ----------------------------

@pytest.mark.parametrize("case_id,field_name,other", [
    ("deepseek_v2_group_limited_greedy", "group_score", "top2_sum"),
    ("deepseek_v2_group_limited_greedy", "num_groups", 1),
    ("gpt_oss", "scoring", "softmax"),
    ("ernie4_5_moe", "use_selection_bias", False),
    ("gpt_oss", "swiglu_limit", 7.0),
])
def test_each_family_rule_changes_the_output(case_id, field_name, other, saved_models):
    """Each rule the cases rely on moves the output beyond the tolerance when replaced (so a rule computed as a
    no-op would have failed the parity tests above)."""
    case = next(c for c in CASES if c.id == case_id)
    folder, model = saved_models(case)
    cfg = MoEConfig.from_hf_config(folder)
    layer = moe_layers_of(model, case)[-1]
    weights = load_moe_weights(folder, cfg, layer)
    x_TD = inputs(3, cfg.hidden_size)
    changed = dataclasses.replace(cfg, **{field_name: other, **({"num_topk_groups": 1} if field_name == "num_groups"
                                                                 else {})})
    expected_TD = hf_block_output(model.model.layers[layer].mlp, x_TD)
    error = float((reference_moe(x_TD, weights, changed) - expected_TD).abs().max() / expected_TD.abs().max())
    assert error > 100 * REL_TOLERANCE, f"{case_id}: {field_name}={other!r} gives the same output ({error:.3g})"


# --- the experts backends: who computes which family's experts ----------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_experts_backends_compute_gpt_oss_experts(backend, saved_models):
    """gpt-oss's clamped SwiGLU and expert biases on the backends that run them, row by row against the oracle's
    one-expert MLP (``activations.dense_mlp``), in a pool with an empty expert and alignment padding."""
    from moe_ref.core.activations import dense_mlp
    from moe_ref.experts import ExpertLayout, make_experts

    case = next(c for c in CASES if c.id == "gpt_oss")
    folder, model = saved_models(case)
    cfg = MoEConfig.from_hf_config(folder)
    weights = load_moe_weights(folder, cfg, moe_layers_of(model, case)[0])
    experts = make_experts(backend, weights.gate_up_weight_E2FD, weights.down_weight_EDF, cfg.activation,
                           swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                           gate_up_bias_e2F=weights.gate_up_bias_E2F, down_bias_eD=weights.down_bias_ED)
    num_rows_e = torch.tensor([3, 0, 5, 1, 2, 4, 0, 6])
    layout = ExpertLayout.from_counts(num_rows_e, experts.segment_alignment)
    x_PDx = torch.randn(layout.num_pool_rows, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    y_PDx = experts(x_PDx, layout)
    for e, (start, count) in enumerate(zip(layout.row_start_e.tolist(), num_rows_e.tolist())):
        expected = dense_mlp(x_PDx[start:start + count], weights.gate_up_weight_E2FD[e], weights.down_weight_EDF[e],
                             cfg.activation, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                             gate_up_bias_2S=weights.gate_up_bias_E2F[e], down_bias_D=weights.down_bias_ED[e])
        if count:
            assert_relative_close(y_PDx[start:start + count], expected, backend=backend, expert=e)
    valid_P = layout.row_expert_P() >= 0
    assert not y_PDx[~valid_P].any(), f"padding rows must stay zero; {backend=}"


def test_backends_without_the_family_math_are_refused_naming_family_feature_and_who_runs_it(saved_models):
    from moe_ref.core.errors import ExpertsFeatureError, explain
    from moe_ref.experts import make_experts
    from moe_ref.experts.registry import check_experts_support

    case = next(c for c in CASES if c.id == "gpt_oss")
    folder, _ = saved_models(case)
    cfg = MoEConfig.from_hf_config(folder)
    with pytest.raises(ExpertsFeatureError, match=r"gpt_oss.*'triton' does not compute activation='swigluoai'.*"
                                                  r"nor expert biases.*torch, grouped_mm") as info:
        check_experts_support(cfg, "triton")
    assert info.value.code == "ENV020" and "swigluoai" in explain("ENV020")
    check_experts_support(cfg, "torch")  # these run it: no error
    check_experts_support(cfg, "grouped_mm")
    check_experts_support(MoEConfig.from_hf_config(saved_models(CASES[0])[0]), "triton")  # SwiGLU, no bias
    weights = load_moe_weights(folder, cfg, 0)
    with pytest.raises(ExpertsFeatureError, match="'triton' does not compute activation='swigluoai'"):
        make_experts("triton", weights.gate_up_weight_E2FD, weights.down_weight_EDF, "swigluoai")
    with pytest.raises(ExpertsFeatureError, match="'triton' does not compute expert biases"):
        make_experts("triton", weights.gate_up_weight_E2FD, weights.down_weight_EDF, "silu",
                     gate_up_bias_e2F=weights.gate_up_bias_E2F, down_bias_eD=weights.down_bias_ED)
