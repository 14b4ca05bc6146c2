"""moe_ref against an independent implementation: HF transformers' DeepSeek-V3 MoE block (fp32, CPU).

Checked: (a) the router (ids as sets per token, weights matched by id), (b) the whole block vs
``reference_moe``, (c) the same after writing the HF module's state dict to safetensors in the transformers
5.x fused form and in the Hub's per-expert naming and reading it back with ``load_moe_weights`` (whole and
as two EP ranks' expert ranges), (d) transformers' own ``from_pretrained`` reading checkpoints written by
``moe_ref.checkpoint.synthetic`` (so our names, orientation and config.json are what transformers expects), (e) the
one-process ``MegaMoE`` loaded with ``load_hf_weights`` from the HF module's checkpoint.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from moe_ref.core.config import MoEConfig, preset
from moe_ref.layer import MegaMoE
from moe_ref.checkpoint.loading import load_moe_weights
from moe_ref.reference import reference_moe
from moe_ref.block import route
from moe_ref.checkpoint.synthetic import write_synthetic_checkpoint
from moe_ref.testing import assert_close
from moe_ref.core.weights import MoEWeights

# transformers is a test dependency: imported plainly so that a missing install fails instead of skipping
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

pytestmark = pytest.mark.unit

LAYER = 1
NUM_TOKENS = 96
GROUPINGS = [(4, 2), (1, 1)]  # (n_group, topk_group): DeepSeek-V3-style grouped, Kimi-K2-style ungrouped


def hf_config(n_group: int, topk_group: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=48, moe_intermediate_size=40, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
        topk_group=topk_group, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        hidden_act="silu", num_hidden_layers=LAYER + 1, first_k_dense_replace=LAYER)


def moe_config(config: DeepseekV3Config) -> MoEConfig:
    # NOTE: DeepseekV3Config.to_dict() carries no scoring_func/topk_method (its router is always sigmoid +
    # noaux_tc); the published DeepSeek-V3/Kimi-K2 config.json files do, so add them as those files have them.
    cfg = MoEConfig.from_hf_config({**config.to_dict(), "scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    assert (cfg.num_groups, cfg.num_topk_groups, cfg.num_experts, cfg.num_topk) == (
        config.n_group, config.topk_group, config.n_routed_experts, config.num_experts_per_tok)
    assert cfg.use_selection_bias and cfg.renormalize and cfg.routed_scaling_factor == 2.5
    assert cfg.shared_intermediate_size == config.moe_intermediate_size * config.n_shared_experts
    return cfg


def hf_moe(config: DeepseekV3Config, seed: int, bias_E: torch.Tensor | None = None) -> DeepseekV3MoE:
    """The HF block with seeded random weights (its own init leaves the experts empty and the router zero)."""
    gen = torch.Generator().manual_seed(seed)
    moe = DeepseekV3MoE(config).float().eval()
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
        E = config.n_routed_experts
        moe.gate.e_score_correction_bias.copy_(0.1 * torch.rand(E, generator=gen) if bias_E is None else bias_E)
    return moe


def weights_from_hf(moe: DeepseekV3MoE) -> MoEWeights:
    """Canonical weights straight from the HF module's tensors (no file involved)."""
    shared = moe.shared_experts
    return MoEWeights(
        gate_weight_ED=moe.gate.weight.detach(), gate_up_weight_E2FD=moe.experts.gate_up_proj.detach(),
        down_weight_EDF=moe.experts.down_proj.detach(), bias_E=moe.gate.e_score_correction_bias.detach(),
        shared_gate_up_weight_2SD=torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach(),
        shared_down_weight_DS=shared.down_proj.weight.detach())


def by_expert_id(ids_TK: torch.Tensor, weights_TK: torch.Tensor):
    """Slots sorted by expert id, so two routers' outputs compare as sets (HF's top-k is unsorted)."""
    order_TK = ids_TK.argsort(dim=-1)
    return ids_TK.gather(1, order_TK), weights_TK.gather(1, order_TK)


def assert_routes_like_hf(moe: DeepseekV3MoE, cfg: MoEConfig, x_TD: torch.Tensor, **case) -> None:
    with torch.no_grad():
        _, hf_weights_TK, hf_ids_TK = moe.gate(x_TD)
    ids_TK, weights_TK = route(x_TD, moe.gate.weight.detach(), cfg, moe.gate.e_score_correction_bias)
    hf_ids_TK, hf_weights_TK = by_expert_id(hf_ids_TK.long(), hf_weights_TK)
    ids_TK, weights_TK = by_expert_id(ids_TK, weights_TK)
    mismatch = (ids_TK != hf_ids_TK).any(dim=1).nonzero().flatten()
    assert mismatch.numel() == 0, f"expert sets differ for tokens {mismatch[:8].tolist()}; {case}"
    assert_close(weights_TK, hf_weights_TK, torch.float32, **case)


def assert_block_like_hf(moe: DeepseekV3MoE, weights: MoEWeights, cfg: MoEConfig, x_TD: torch.Tensor, **case):
    with torch.no_grad():
        expected_TD = moe(x_TD)
    actual_TD = reference_moe(x_TD, weights, cfg)
    assert expected_TD.abs().max() > 0.1, "degenerate case: the HF output is ~0"
    assert_close(actual_TD, expected_TD, torch.float32, **case)


def inputs(seed: int, hidden: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, hidden, generator=torch.Generator().manual_seed(seed))


# --- (a) router and (b) block ----------------------------------------------------------------------------

@pytest.mark.parametrize("n_group,topk_group", GROUPINGS)
def test_router_matches_hf(n_group, topk_group):
    config = hf_config(n_group, topk_group)
    cfg, moe = moe_config(config), hf_moe(config, seed=1)
    x_TD = inputs(2, config.hidden_size)
    assert_routes_like_hf(moe, cfg, x_TD, n_group=n_group, topk_group=topk_group)
    if n_group > 1:  # the case exercises the groups: ungrouped top-k would pick differently for some tokens
        ungrouped = dataclasses.replace(cfg, num_groups=1, num_topk_groups=1)
        grouped_ids = route(x_TD, moe.gate.weight.detach(), cfg, moe.gate.e_score_correction_bias)[0]
        free_ids = route(x_TD, moe.gate.weight.detach(), ungrouped, moe.gate.e_score_correction_bias)[0]
        assert (grouped_ids.sort().values != free_ids.sort().values).any()


@pytest.mark.parametrize("n_group,topk_group", GROUPINGS)
def test_block_matches_hf(n_group, topk_group):
    config = hf_config(n_group, topk_group)
    cfg, moe = moe_config(config), hf_moe(config, seed=3)
    assert_block_like_hf(moe, weights_from_hf(moe), cfg, inputs(4, config.hidden_size),
                         n_group=n_group, topk_group=topk_group)


def test_negative_bias_masks_dropped_groups_like_installed_hf():
    """With a negative bias, kept experts can have selection scores < 0. The installed transformers masks the
    dropped groups with -inf, as moe_ref does (older transformers filled 0.0, which lets dropped-group
    experts win there); this case is built so that a 0.0 fill WOULD pick differently, so it tells the two
    apart."""
    config = hf_config(4, 2)
    gen = torch.Generator().manual_seed(5)
    bias_E = -0.8 - 0.4 * torch.rand(config.n_routed_experts, generator=gen)  # every selection score < 0.2 - 0.8
    cfg, moe = moe_config(config), hf_moe(config, seed=6, bias_E=bias_E)
    x_TD = inputs(7, config.hidden_size)
    assert_routes_like_hf(moe, cfg, x_TD, bias="negative")

    # what a 0.0 group mask would select: the top-k of the selection scores with dropped groups set to 0.0
    scores_TE = (x_TD @ moe.gate.weight.detach().t()).sigmoid() + bias_E
    group_scores_TG = scores_TE.view(NUM_TOKENS, 4, -1).topk(2, dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, group_scores_TG.topk(2).indices, True)
    zero_filled_TE = scores_TE.masked_fill(~keep_TG.repeat_interleave(4, dim=1), 0.0)
    zero_fill_ids_TK = zero_filled_TE.topk(cfg.num_topk, dim=-1).indices.sort().values
    ids_TK = route(x_TD, moe.gate.weight.detach(), cfg, bias_E)[0].sort().values
    assert (zero_fill_ids_TK != ids_TK).any(dim=1).all(), "the case does not separate -inf from 0.0 masking"
    assert_block_like_hf(moe, weights_from_hf(moe), cfg, x_TD, bias="negative")


# --- (c) HF state dict -> safetensors -> load_moe_weights ---------------------------------------------------

def save_fused(moe: DeepseekV3MoE, path) -> None:
    """The raw state dict as transformers 5.x holds it, under ``model.layers.{L}.mlp.`` (no conversion)."""
    tensors = {f"model.layers.{LAYER}.mlp.{name}": value.contiguous() for name, value in moe.state_dict().items()}
    assert f"model.layers.{LAYER}.mlp.experts.gate_up_proj" in tensors, sorted(tensors)
    save_file(tensors, str(path))


def save_hub(moe: DeepseekV3MoE, path) -> None:
    """The Hub's per-expert naming, split by hand here (transformers merges it back as
    ``gate_up_proj[e] = cat(gate_proj, up_proj)``, ``down_proj[e] = down_proj``)."""
    state, prefix, F = moe.state_dict(), f"model.layers.{LAYER}.mlp.", moe.experts.intermediate_dim
    tensors = {prefix + name: value.contiguous() for name, value in state.items() if not name.startswith("experts.")}
    for e in range(moe.experts.num_experts):
        tensors[f"{prefix}experts.{e}.gate_proj.weight"] = state["experts.gate_up_proj"][e, :F].contiguous()
        tensors[f"{prefix}experts.{e}.up_proj.weight"] = state["experts.gate_up_proj"][e, F:].contiguous()
        tensors[f"{prefix}experts.{e}.down_proj.weight"] = state["experts.down_proj"][e].contiguous()
    save_file(tensors, str(path))


@pytest.mark.parametrize("layout", ["fused", "hub"])
@pytest.mark.parametrize("n_group,topk_group", GROUPINGS)
def test_hf_state_dict_through_safetensors_matches_hf(tmp_path, layout, n_group, topk_group):
    config = hf_config(n_group, topk_group)
    cfg, moe = moe_config(config), hf_moe(config, seed=8)
    path = tmp_path / "model.safetensors"
    (save_fused if layout == "fused" else save_hub)(moe, path)
    x_TD = inputs(9, config.hidden_size)
    case = dict(layout=layout, n_group=n_group, topk_group=topk_group)

    loaded = load_moe_weights(path, cfg, LAYER)
    expected = weights_from_hf(moe)
    for field in dataclasses.fields(MoEWeights):
        value, ref = getattr(loaded, field.name), getattr(expected, field.name)
        same = torch.equal(value, ref) if isinstance(ref, torch.Tensor) and value is not None else value == ref
        assert same, (field.name, case)
    assert_block_like_hf(moe, loaded, cfg, x_TD, **case)

    half = cfg.num_experts // 2  # two EP ranks, each reading only its experts, put back together
    ranks = [load_moe_weights(path, cfg, LAYER, expert_range=(r * half, half)) for r in range(2)]
    assert [r.first_expert for r in ranks] == [0, half]
    joined = dataclasses.replace(ranks[0], gate_up_weight_E2FD=torch.cat([r.gate_up_weight_E2FD for r in ranks]),
                                 down_weight_EDF=torch.cat([r.down_weight_EDF for r in ranks]))
    assert_block_like_hf(moe, joined, cfg, x_TD, ranks=2, **case)


# --- (d) transformers reads what moe_ref.checkpoint.synthetic writes ------------------------------------------------------

TINY_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=64, intermediate_size=64)


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_transformers_from_pretrained_reads_the_synthetic_checkpoint(tmp_path, layout):
    """transformers' loader (with its per-expert -> fused conversion for the hub layout) reads our files and
    config.json; its MoE block then equals ``reference_moe`` on ``load_moe_weights`` of the same files."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    cfg = preset("tiny-deepseek-v3")
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, layout=layout, dtype=torch.float32, seed=10)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # it reports the (attention, embedding) weights we did not write
    try:
        model = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **TINY_ATTENTION).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    mlp = model.model.layers[LAYER].mlp
    assert isinstance(mlp, DeepseekV3MoE), f"layer {LAYER} is not an MoE layer in transformers: {type(mlp)}"
    assert (mlp.gate.num_group, mlp.gate.topk_group, mlp.gate.top_k) == (cfg.num_groups, cfg.num_topk_groups,
                                                                         cfg.num_topk)
    assert torch.equal(mlp.experts.gate_up_proj.detach(), written.gate_up_weight_E2FD), layout
    assert torch.equal(mlp.experts.down_proj.detach(), written.down_weight_EDF), layout
    assert torch.equal(mlp.gate.e_score_correction_bias, written.bias_E), layout
    loaded = load_moe_weights(tmp_path, MoEConfig.from_hf_config(tmp_path), LAYER)
    assert_block_like_hf(mlp, loaded, cfg, inputs(11, cfg.hidden_size), layout=layout)


# --- (e) the layer: MegaMoE.load_hf_weights on the HF module's checkpoint ------------------------------------

@pytest.mark.parametrize("layout", ["fused", "hub"])
@pytest.mark.parametrize("n_group,topk_group", GROUPINGS)
def test_mega_moe_loaded_from_hf_checkpoint_matches_hf(tmp_path, layout, n_group, topk_group):
    config = hf_config(n_group, topk_group)
    cfg, moe = moe_config(config), hf_moe(config, seed=12)
    (save_fused if layout == "fused" else save_hub)(moe, tmp_path / "model.safetensors")
    layer = MegaMoE(cfg, num_max_tokens_per_rank=NUM_TOKENS, dtype=torch.float32)
    layer.load_hf_weights(tmp_path, layer_idx=LAYER)
    x_TD = inputs(13, config.hidden_size)
    with torch.no_grad():
        expected_TD = moe(x_TD)
        actual_TD = layer(x_TD)
    layer.destroy()
    assert_close(actual_TD, expected_TD, torch.float32, layout=layout, n_group=n_group, topk_group=topk_group)
