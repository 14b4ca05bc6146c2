"""The flagship checkpoints as published, at tiny sizes: each layout is written at test time (two shards and a
model.safetensors.index.json, config.json with the model's quantization_config), loaded ONLY through the
public API ``MegaMoE(<dir>, None, ...).load_hf_weights(<dir>, layer_idx)``, and compared with a reference
that reads the shards with safetensors and dequantizes every tensor itself, from the format's definition
(the dequantizers below; moe_ref's own are not called). The reference block math is
``moe_ref.reference.reference_moe`` (pure torch, pinned against transformers' DeepseekV3MoE in
tests/unit/test_hf_parity.py); what is independent here is every weight it is given.

Where each layout fact comes from (the project research notes "Anchors 2", section 5, and their sources):

* DeepSeek-V3 / R1 FP8: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` float8_e4m3fn + ``.weight_scale_inv``
  fp32 ``[ceil(O/128), ceil(I/128)]``; ``quantization_config = {quant_method: fp8, fmt: e4m3,
  activation_scheme: dynamic, weight_block_size: [128, 128]}``, no ignore list: every Linear is FP8, shared
  experts included; the router ``mlp.gate.weight`` (DeepSeek's ``Gate``, a bare parameter) and
  ``e_score_correction_bias`` are not. Dequantization ``w = q * s`` per 128x128 block, edge blocks padded:
  DeepSeek-V3 README_WEIGHTS.md and ``inference/kernel.py`` ``weight_dequant``; vLLM/SGLang ``deepseek_v2.py``
  build the gate with ``quant_config=None``.
* Kimi-K2-Instruct FP8: the same architecture (``DeepseekV3ForCausalLM``, model_type kimi_k2) and the same
  block-FP8 layout and quantization_config (anchors-2 §5, hf-model-inspector report of the repo).
* Kimi-K2-Thinking INT4: compressed-tensors ``pack-quantized`` (vllm-project/compressed-tensors
  ``compressors/quantized_compressors/pack_quantized.py``): ``weight_packed`` int32 ``[O, I/8]``, value k is
  the nibble at bits ``4*(k%8)`` of word ``k//8``, stored offset-binary ``q + 8``; ``weight_scale`` bf16
  ``[O, I/32]``; ``weight_shape`` int32 ``[O, I]``; ``w = q * s``. The ignore list
  ``[lm_head, re:.*self_attn.*, re:.*shared_experts.*, re:.*mlp\\.(gate|up|gate_up|down)_proj.*]`` keeps the
  shared experts bf16 (the Kimi-K2-Thinking config, anchors-2 §5).
* Kimi-K3 MXFP4: compressed-tensors ``mxfp4-pack-quantized`` (vLLM ``CompressedTensorsW4A16Mxfp4``,
  compressed-tensors ``fp4_quantized.py`` / ``mxfp4_utils.py``): ``weight_packed`` uint8 ``[O, I/2]``,
  element 2j is the low nibble of byte j; E2M1 nibble: bit 3 sign, magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6);
  ``weight_scale`` uint8 ``[O, I/32]`` stored as ``127 + floor(log2 s) - 2`` (``compress_scale``; vLLM adds 2
  to reach E8M0, "a bias of 125"), so ``s = 2**(byte - 125)``. Names ``language_model.layers.{L}.
  block_sparse_moe.experts.{e}.{w1,w3,w2}`` (w1 gate, w3 up, w2 down); the latent projections
  ``routed_expert_{down,up}_proj`` and norm are bf16 (built with ``quant_config=None``); shared experts
  ignored (``re:.*shared_experts.*``).
* Step3 bf16: stacked ``model.layers.{L}.moe.{gate,up}_proj.weight [E, F, D]``, ``moe.down_proj.weight
  [E, D, F]`` (vLLM ``step3_text.py`` ``expert_params_mapping`` slices ``loaded_weight[expert_id]``); router
  ``moe.gate.weight [E, D]``; shared ``share_expert.{gate,up,down}_proj.weight``.
* Step3 FP8: the same stacked tensors in float8_e4m3fn with ``weight_scale_inv [E, O/128, I/128]`` (StepFun
  README "bf16 and block-fp8"; the Step-3.5-Flash-FP8 dump ``(288, 10, 32)``; TRT-LLM's Step3 loader
  ``(N, I/128, H/128)``), and ``share_expert.*_proj`` FP8 with 128x128 scales too (the shared-expert tensors
  a Step3 FP8 load used to refuse with LOAD003).
  Its quantization_config is taken to be DeepSeek's (quant_method fp8, [128, 128] blocks): the exact
  file was not re-read (anchors-2 marks the FP8 scale names [U]).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from moe_ref.core.config import MoEConfig, hf_config_dict, preset
from moe_ref.core.errors import InvalidConfigError, QuantizationMismatchError, UnknownFamilyError
from moe_ref.checkpoint.synthetic import QUANTIZATION_CONFIGS, write_synthetic_checkpoint
from moe_ref.core.weights import MoEWeights
from moe_ref.layer import MegaMoE
from moe_ref.reference import reference_moe
from moe_ref.testing import calc_diff

pytestmark = pytest.mark.unit

LAYER = 1
BLOCK = 128

# the published quantization_config of each layout, written out here (not read from moe_ref)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_CT_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                  "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None,
                                              "observer": "minmax", "block_structure": None}}},
    "ignore": _CT_IGNORE, "kv_cache_scheme": None}
MXFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                  "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "observer": "minmax"}}},
    "ignore": _CT_IGNORE + ["re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"], "kv_cache_scheme": None}


@dataclasses.dataclass(frozen=True)
class Layout:
    preset: str
    quant: str | None            # moe_ref's name of the format (what the writer is asked for)
    qconfig: dict | None         # the published quantization_config (checked against what the writer wrote)
    sizes: dict
    prefix: str                  # the text before the layer number, as published
    moe: str                     # the MoE module, as published
    experts: tuple[str, str, str]  # gate, up, down under moe (``{e}``: per expert; else stacked [E, O, I])
    shared: tuple[str, str, str]   # shared gate, up, down (full names after the layer prefix)
    shared_stored: str | None    # the shared experts' format as published (None: bf16)
    latent: bool = False


LAYOUTS = {
    "deepseek-v3-fp8": Layout("tiny-deepseek-v3", "fp8_block", FP8_CONFIG,
                              dict(hidden_size=160, intermediate_size=128), "model.layers.", "mlp.",
                              ("experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj"),
                              ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                               "mlp.shared_experts.down_proj"), "fp8"),
    "kimi-k2-instruct-fp8": Layout("tiny-kimi-k2", "fp8_block", FP8_CONFIG, dict(intermediate_size=128),
                                   "model.layers.", "mlp.",
                                   ("experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj"),
                                   ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                    "mlp.shared_experts.down_proj"), "fp8"),
    "kimi-k2-thinking-int4": Layout("tiny-kimi-k2", "int4_group", INT4_CONFIG,
                                    dict(hidden_size=64, intermediate_size=32), "model.layers.", "mlp.",
                                    ("experts.{e}.gate_proj", "experts.{e}.up_proj", "experts.{e}.down_proj"),
                                    ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                                     "mlp.shared_experts.down_proj"), None),
    "kimi-k3-mxfp4": Layout("tiny-kimi-k3", "mxfp4", MXFP4_CONFIG, dict(intermediate_size=32),
                            "language_model.layers.", "block_sparse_moe.",
                            ("experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2"),
                            ("block_sparse_moe.shared_experts.gate_proj", "block_sparse_moe.shared_experts.up_proj",
                             "block_sparse_moe.shared_experts.down_proj"), None, latent=True),
    "step3-bf16": Layout("tiny-step3", None, None, dict(), "model.layers.", "moe.",
                         ("gate_proj", "up_proj", "down_proj"),
                         ("share_expert.gate_proj", "share_expert.up_proj", "share_expert.down_proj"), None),
    "step3-fp8": Layout("tiny-step3", "fp8_block", FP8_CONFIG,
                        dict(hidden_size=160, intermediate_size=128, shared_intermediate_size=136),
                        "model.layers.", "moe.", ("gate_proj", "up_proj", "down_proj"),
                        ("share_expert.gate_proj", "share_expert.up_proj", "share_expert.down_proj"), "fp8"),
}


# --- the reference's dequantizers, from each format's definition ----------------------------------------

def dequant_fp8_block(q: torch.Tensor, s_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 ``weight_dequant``: every 128x128 block of ``q`` times its ``weight_scale_inv``
    (edge blocks cover what is left). ``[..., O, I]`` with scales ``[..., ceil(O/128), ceil(I/128)]``."""
    out = q.to(torch.float32).clone()
    O, I = q.shape[-2:]
    for bi in range(-(-O // BLOCK)):
        for bj in range(-(-I // BLOCK)):
            rows, cols = slice(bi * BLOCK, (bi + 1) * BLOCK), slice(bj * BLOCK, (bj + 1) * BLOCK)
            out[..., rows, cols] *= s_inv[..., bi, bj, None, None]
    return out


def dequant_int4_packed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized: nibble k % 8 (bits 4*(k%8)) of int32 word k // 8, offset-binary."""
    O, I = (int(v) for v in shape.tolist())
    words = packed.to(torch.int64) & 0xFFFFFFFF                     # the 32 bits, unsigned
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(O, -1)[:, :I]
    q = (nibbles - 8).to(torch.float32)
    return q * scale.to(torch.float32).repeat_interleave(32, dim=-1)[:, :I]


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors mxfp4-pack-quantized: low nibble = element 2j, high = 2j+1; bit 3 the sign;
    scale byte b means 2**(b - 125)."""
    b = packed.to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return values * torch.pow(2.0, scale.to(torch.float32) - 125).repeat_interleave(32, dim=-1)


# --- reading the shards ----------------------------------------------------------------------------------

def read_shards(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        tensors.update(load_file(str(folder / shard)))
    assert set(tensors) == set(index)
    return tensors


def dense_weight(t: dict, module: str, stored: str | None) -> torch.Tensor:
    """Module ``module``'s weight as the checkpoint means it (fp32), from its stored tensors."""
    if stored is None:
        assert f"{module}.weight" in t and t[f"{module}.weight"].dtype == torch.bfloat16, module
        return t[f"{module}.weight"].float()
    if stored == "fp8":
        assert t[f"{module}.weight"].dtype == torch.float8_e4m3fn, module
        return dequant_fp8_block(t[f"{module}.weight"], t[f"{module}.weight_scale_inv"])
    if stored == "int4":
        return dequant_int4_packed(t[f"{module}.weight_packed"], t[f"{module}.weight_scale"],
                                   t[f"{module}.weight_shape"])
    return dequant_mxfp4(t[f"{module}.weight_packed"], t[f"{module}.weight_scale"])


ROUTED_STORED = {"fp8_block": "fp8", "int4_group": "int4", "mxfp4": "mxfp4", None: None}


def reference_weights(folder, lay: Layout, cfg: MoEConfig) -> MoEWeights:
    t = read_shards(folder)
    p = f"{lay.prefix}{LAYER}."
    m = p + lay.moe
    stored = ROUTED_STORED[lay.quant]
    if "{e}" in lay.experts[0]:
        per = [[dense_weight(t, m + name.format(e=e), stored) for e in range(cfg.num_experts)] for name in lay.experts]
        gate, up, down = (torch.stack(w) for w in per)
    else:
        gate, up, down = (dense_weight(t, m + name, stored) for name in lay.experts)
    shared = [dense_weight(t, p + name, lay.shared_stored) for name in lay.shared]
    return MoEWeights(
        gate_weight_ED=t[m + "gate.weight"].float(),
        gate_up_weight_E2FD=torch.cat([gate, up], dim=1), down_weight_EDF=down,
        bias_E=t[m + "gate.e_score_correction_bias"].float() if cfg.use_selection_bias else None,
        shared_gate_up_weight_2SD=torch.cat(shared[:2]), shared_down_weight_DS=shared[2],
        latent_down_weight_LD=t[m + "routed_expert_down_proj.weight"].float() if lay.latent else None,
        latent_up_weight_DL=t[m + "routed_expert_up_proj.weight"].float() if lay.latent else None,
        latent_norm_weight_L=t[m + "routed_expert_norm.weight"].float() if lay.latent else None)


def layout_config(lay: Layout) -> MoEConfig:
    cfg = dataclasses.replace(preset(lay.preset), **lay.sizes)
    if cfg.family != "step3":  # DeepSeek-V3/Kimi: shared width = n_shared_experts * moe_intermediate_size
        cfg = dataclasses.replace(cfg, shared_intermediate_size=cfg.num_shared_experts * cfg.intermediate_size)
    return cfg


def write_layout(folder, case: str) -> MoEConfig:
    lay = LAYOUTS[case]
    cfg = layout_config(lay)
    write_synthetic_checkpoint(folder, cfg, layer_idx=LAYER, quant=lay.quant, seed=11, num_shards=2,
                               dtype=torch.bfloat16)
    written = json.loads((folder / "config.json").read_text())
    text = written.get("text_config", written)
    assert written.get("quantization_config") == lay.qconfig, "the writer's quantization_config is the published one"
    assert len(list(folder.glob("*.safetensors"))) == 2 and (folder / "model.safetensors.index.json").is_file()
    assert text["model_type" if "model_type" in text else "hidden_size"] is not None
    return cfg


RESULTS: dict[str, str] = {}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_published_layout_loads_through_the_public_api_and_matches(tmp_path, case):
    lay = LAYOUTS[case]
    cfg = write_layout(tmp_path, case)
    layer = MegaMoE(tmp_path, None, num_max_tokens_per_rank=64, dtype=torch.float32)
    assert layer.cfg.family == cfg.family and layer.cfg.hidden_size == cfg.hidden_size
    layer.load_hf_weights(tmp_path, LAYER)

    ref = reference_weights(tmp_path, lay, cfg)
    # the shared experts the layer holds: dequantized once at load (FP8) or read as stored (bf16)
    shared_err = max(float((layer.shared_gate_up_weight - ref.shared_gate_up_weight_2SD).abs().max()),
                     float((layer.shared_down_weight - ref.shared_down_weight_DS).abs().max()))
    assert shared_err <= 1e-6, (case, shared_err)
    assert float((layer.gate_weight - ref.gate_weight_ED).abs().max()) == 0.0

    report = layer.load_report()
    read_q, held = report.dequantized_bytes()
    S, D = cfg.shared_intermediate_size, cfg.hidden_size
    if lay.shared_stored == "fp8":  # 3 weights: fp8 bytes + fp32 128x128 scales read, fp32 held
        blocks = 2 * (-(-S // BLOCK)) * (-(-D // BLOCK)) + (-(-D // BLOCK)) * (-(-S // BLOCK))
        assert (read_q, held) == (3 * S * D + 4 * blocks, 3 * S * D * 4), report.summary()
        assert "dequantized once at load" in report.summary()
    else:
        assert report.dequantized() == [], report.summary()

    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = layer(x)
        y_ref = reference_moe(x, ref, cfg)
    layer.destroy()
    diff, max_err = calc_diff(y, y_ref), float((y - y_ref).abs().max())
    RESULTS[case] = (f"calc_diff {diff:.2e}, max |y - y_ref| {max_err:.2e} (|y_ref| max "
                     f"{float(y_ref.abs().max()):.2e}), shared max err {shared_err:.1e}; {report.summary()}")
    print(f"\n{case}: {RESULTS[case]}")
    assert diff <= 1e-10, (case, diff)
    assert float(y_ref.abs().max()) > 0


# --- the config decides: mismatches are LOAD014, ignore lists are honoured -------------------------------

def test_fp8_config_beside_bf16_shared_experts_is_load014(tmp_path):
    cfg = layout_config(LAYOUTS["deepseek-v3-fp8"])
    # written with the shared experts left bf16 (an ignored_layers entry), then given the published config
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant="fp8_block", num_shards=2,
                               quantization_config={**FP8_CONFIG, "ignored_layers": ["shared_experts"]})
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8_CONFIG}))
    layer = MegaMoE(tmp_path, None, num_max_tokens_per_rank=64)
    with pytest.raises(QuantizationMismatchError, match="shared_experts.gate_proj.weight") as info:
        layer.load_hf_weights(tmp_path, LAYER)
    assert info.value.code == "LOAD014" and "quant_method 'fp8' quantizes every Linear" in str(info.value)


def test_fp8_ignored_layers_keep_the_shared_experts_plain(tmp_path):
    """QuantSpec.ignore is used: a module in ignored_layers is read plain, and matches."""
    lay = LAYOUTS["deepseek-v3-fp8"]
    cfg = layout_config(lay)
    ignored = [f"model.layers.{LAYER}.mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant="fp8_block", num_shards=2,
                               quantization_config={**FP8_CONFIG, "ignored_layers": ignored})
    layer = MegaMoE(tmp_path, None, num_max_tokens_per_rank=64).load_hf_weights(tmp_path, LAYER)
    ref = reference_weights(tmp_path, dataclasses.replace(lay, shared_stored=None), cfg)
    assert torch.equal(layer.shared_down_weight, ref.shared_down_weight_DS)
    assert layer.load_report().dequantized() == []
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert calc_diff(layer(x), reference_moe(x, ref, cfg)) <= 1e-10


def test_compressed_tensors_ignore_beside_quantized_shared_experts_is_load014(tmp_path):
    cfg = layout_config(LAYOUTS["kimi-k2-thinking-int4"])
    without_shared = [e for e in _CT_IGNORE if "shared_experts" not in e]
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant="int4_group", num_shards=2,
                               quantization_config={**INT4_CONFIG, "ignore": without_shared})
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": INT4_CONFIG}))
    with pytest.raises(QuantizationMismatchError, match=r"shared_experts.gate_proj.*re:\.\*shared_experts") as info:
        MegaMoE(tmp_path, None, num_max_tokens_per_rank=64).load_hf_weights(tmp_path, LAYER)
    assert info.value.code == "LOAD014"


def test_fp8_config_beside_bf16_routed_experts_is_load014(tmp_path):
    cfg = layout_config(LAYOUTS["step3-fp8"])
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, num_shards=2)  # all bf16
    raw = json.loads((tmp_path / "config.json").read_text())
    # the shared expert left plain on purpose, so that the routed experts are what disagrees
    qc = {**FP8_CONFIG, "ignored_layers": ["share_expert"]}
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
    with pytest.raises(QuantizationMismatchError, match=r"model.layers.1.moe.gate_proj.weight.*plain BF16"):
        MegaMoE(tmp_path, None, num_max_tokens_per_rank=64).load_hf_weights(tmp_path, LAYER)


def test_the_writer_uses_the_published_configs():
    from moe_ref.checkpoint.formats import QuantFormat

    assert QUANTIZATION_CONFIGS[QuantFormat.FP8_BLOCK] == FP8_CONFIG
    assert QUANTIZATION_CONFIGS[QuantFormat.INT4_GROUP] == INT4_CONFIG
    assert QUANTIZATION_CONFIGS[QuantFormat.MXFP4] == MXFP4_CONFIG


# --- families are named, not guessed ------------------------------------------------------------------------

# DBRX: a MoE family moe_ref has no module for (a real model_type, published config fields)
DBRX = {"model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "d_model": 6144, "n_layers": 40,
        "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752}}


def test_an_unknown_family_is_refused_by_name(tmp_path):
    with pytest.raises(UnknownFamilyError, match="dbrx") as info:
        MoEConfig.from_hf_config(DBRX)
    message = str(info.value)
    assert info.value.code == "CFG018" and isinstance(info.value, InvalidConfigError)
    assert all(t in message for t in ("deepseek_v3", "kimi_k2", "kimi_k3", "step3_text", "qwen3_moe", "gpt_oss"))
    assert "moe_ref/core/families" in message  # how to add one
    (tmp_path / "config.json").write_text(json.dumps(DBRX))
    with pytest.raises(UnknownFamilyError, match="dbrx"):
        MegaMoE(tmp_path, None)
    with pytest.raises(UnknownFamilyError, match="no model_type"):
        MoEConfig.from_hf_config({k: v for k, v in DBRX.items() if k != "model_type"})


def test_custom_stays_for_configs_built_in_code():
    cfg = MoEConfig(num_experts=8, num_topk=2, hidden_size=32, intermediate_size=16, scoring="softmax",
                    use_selection_bias=False)
    assert cfg.family == "custom"
    assert MoEConfig.from_hf_config(hf_config_dict(preset("tiny-step3"))).family == "step3"


def test_quant_spec_rule_names_the_entry_that_decided():
    from moe_ref.checkpoint.formats import quant_spec_from_config

    ct = quant_spec_from_config({"quantization_config": INT4_CONFIG})
    assert ct.quantizes("model.layers.1.mlp.shared_experts.gate_proj") == (
        False, "quantization_config.ignore entry 're:.*shared_experts.*'")
    assert ct.quantizes("language_model.model.layers.1.mlp.experts.3.down_proj")[0]   # K2.5's prefix too
    assert not ct.quantizes("model.layers.0.mlp.gate_proj")[0]                        # the dense layer 0 MLP
    hf = quant_spec_from_config({"quantization_config": {**FP8_CONFIG, "modules_to_not_convert": ["shared_experts"]}})
    assert hf.quantizes("model.layers.1.mlp.shared_experts.up_proj") == (
        False, "quantization_config.modules_to_not_convert entry 'shared_experts'")
    assert hf.quantizes("model.layers.1.mlp.experts.0.up_proj")[0]
    assert not hf.quantizes("model.layers.1.mlp.shared_experts_x.up_proj")[1].startswith("quantization_config")


def test_a_quantized_router_under_a_quantized_config_is_load014(tmp_path):
    cfg = layout_config(LAYOUTS["kimi-k2-instruct-fp8"])
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant="fp8_block")
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    router = f"model.layers.{LAYER}.mlp.gate.weight"
    tensors[router] = tensors[router].to(torch.float8_e4m3fn)
    save_file(tensors, str(path))
    with pytest.raises(QuantizationMismatchError, match=r"mlp.gate.weight.*F8_E4M3.*router gate"):
        MegaMoE(tmp_path, None, num_max_tokens_per_rank=64).load_hf_weights(tmp_path, LAYER)
