"""Quantized checkpoints as published: synthetic files of each format load as stored, one rank's experts at a
time, and the experts' output equals a reference built from the dequantized weights; bad files get coded errors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_ref.core.config import preset
from moe_ref.core.errors import (
    CorruptIndexError,
    CorruptSafetensorsError,
    FP8AlignmentError,
    MissingScaleError,
    MissingShardError,
    MissingTensorError,
    QuantTensorDTypeError,
    QuantTensorShapeError,
    QuantTensorValueError,
    UnsafeShardPathError,
    UnsupportedQuantizationError,
)
from moe_ref.experts import ExpertLayout, make_experts
from moe_ref.experts.quantized import QuantTorchExperts, make_quantized_experts
from moe_ref.checkpoint.loading import load_moe_weights
from moe_ref.checkpoint.formats import QuantFormat, expert_weight_bytes, quant_spec_from_config
from moe_ref.checkpoint.quantized import checkpoint_quant_spec, load_quantized_experts
from moe_ref.checkpoint.synthetic import quantizable_config, write_synthetic_checkpoint
from moe_ref.testing import calc_diff

pytestmark = pytest.mark.unit

LAYER = 1
# (preset, format, size overrides): INT4/MXFP4 need D, F multiples of 32; FP8 blocks need F % 128 == 0
CASES = {
    "kimi-k2-instruct-fp8": ("tiny-kimi-k2", "fp8_block", dict(intermediate_size=128)),
    "deepseek-v3-fp8": ("tiny-deepseek-v3", "fp8_block", dict(intermediate_size=128)),
    "step3-fp8-stacked": ("tiny-step3", "fp8_block", dict(intermediate_size=128)),
    "kimi-k2-thinking-int4": ("tiny-kimi-k2", "int4_group", dict(hidden_size=64, intermediate_size=32)),
    "kimi-k3-mxfp4": ("tiny-kimi-k3", "mxfp4", dict(intermediate_size=32)),
}


def _cfg(case):
    name, _, overrides = CASES[case]
    return quantizable_config(dataclasses.replace(preset(name), **overrides), CASES[case][1])


def _write(tmp_path, case, **kwargs):
    cfg = _cfg(case)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant=CASES[case][1], seed=5, **kwargs)
    return cfg, written


def _stored_bytes(ckpt_dir, names) -> int:
    total = 0
    for file in ckpt_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            total += sum(handle.get_tensor(n).nbytes for n in handle.keys() if n in names)
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_loads_its_experts_as_stored(tmp_path, case):
    cfg, written = _write(tmp_path, case, num_shards=3)
    spec = quant_spec_from_config(tmp_path)
    assert spec.format == QuantFormat(CASES[case][1])
    count = cfg.num_experts // 2
    for rank in range(2):
        first = rank * count
        q = load_quantized_experts(tmp_path, cfg, LAYER, (first, count), progress=False)
        assert q.first_expert == first and q.num_experts == count
        assert q.gate_up_qweight_e2FDq.dtype == spec.weight_dtype  # stored dtype, no bf16 round trip
        gate_up, down = q.dequantize()
        assert torch.equal(gate_up, written.gate_up_weight_E2FD[first:first + count]), f"{case=} {rank=}"
        assert torch.equal(down, written.down_weight_EDF[first:first + count]), f"{case=} {rank=}"
        # device bytes == the checkpoint's bytes of these experts' weights + scales
        expected = expert_weight_bytes(spec, cfg.expert_hidden_size, cfg.intermediate_size, count)
        assert q.nbytes() == expected, (case, q.nbytes(), expected)
    if CASES[case][0] != "tiny-step3":  # per-expert tensors: sum their stored bytes from the files
        names = {n for f in tmp_path.glob("*.safetensors") for n in load_file(str(f))
                 if ".experts." in n and "shared" not in n and not n.endswith("weight_shape")}
        assert _stored_bytes(tmp_path, names) == expert_weight_bytes(spec, cfg.expert_hidden_size,
                                                                     cfg.intermediate_size, cfg.num_experts)


@pytest.mark.parametrize("case", ["kimi-k2-thinking-int4", "kimi-k3-mxfp4", "kimi-k2-instruct-fp8"])
def test_a_rank_needs_only_its_experts_in_the_checkpoint(tmp_path, case):
    cfg, written = _write(tmp_path, case)
    path = tmp_path / "model.safetensors"
    keep = range(4, 8)
    save_file({n: v for n, v in load_file(str(path)).items()
               if ".experts." not in n or "shared" in n or int(n.split(".experts.")[1].split(".")[0]) in keep},
              str(path))
    q = load_quantized_experts(tmp_path, cfg, LAYER, (4, 4), progress=False)
    assert torch.equal(q.dequantize()[1], written.down_weight_EDF[4:8])
    with pytest.raises(MissingTensorError, match=r"experts\.0\.") as info:
        load_quantized_experts(tmp_path, cfg, LAYER, (0, 4), progress=False)
    assert info.value.code == "LOAD001"


@pytest.mark.parametrize("case", list(CASES))
def test_experts_output_equals_the_dequantized_reference(tmp_path, case):
    cfg, written = _write(tmp_path, case)
    q = load_quantized_experts(tmp_path, cfg, LAYER, (0, cfg.num_experts), progress=False)
    gen = torch.Generator().manual_seed(0)
    layout = ExpertLayout.from_counts(torch.tensor([3, 0, 5] + [1] * (cfg.num_experts - 3)), alignment=128)
    x_PDx = torch.randn(layout.num_pool_rows, cfg.expert_hidden_size, generator=gen)
    reference = make_experts("torch", written.gate_up_weight_E2FD.float(), written.down_weight_EDF.float(),
                             cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    experts = make_quantized_experts(q, cfg.activation, cfg.situ_beta, cfg.situ_linear_beta, backend="torch")
    assert isinstance(experts, QuantTorchExperts)
    y, y_ref = experts(x_PDx, layout), reference(x_PDx, layout)
    assert torch.equal(y, y_ref), calc_diff(y, y_ref)
    assert calc_diff(y_ref, torch.zeros_like(y_ref)) == 1.0  # nonzero: the comparison can fail


def test_kimi_k25_prefix_and_the_progress_bar(tmp_path, capsys):
    cfg, written = _write(tmp_path, "kimi-k2-thinking-int4", prefix="language_model.model.layers.")
    assert any(n.startswith("language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed")
               for n in load_file(str(tmp_path / "model.safetensors")))
    q = load_quantized_experts(tmp_path, cfg, LAYER, (0, 2))
    assert torch.equal(q.dequantize()[0], written.gate_up_weight_E2FD[:2])
    assert "layer 1 experts" in capsys.readouterr().err
    load_quantized_experts(tmp_path, cfg, LAYER, (0, 2), progress=False)
    assert capsys.readouterr().err == ""


def test_plain_loader_still_refuses_quantized_experts(tmp_path):
    cfg, _ = _write(tmp_path, "kimi-k3-mxfp4")
    with pytest.raises(Exception) as info:
        load_moe_weights(tmp_path, cfg, LAYER)
    assert info.value.code == "LOAD003"


# --- bad quantized tensors ------------------------------------------------------------------------------------

def _edit(tmp_path, edit):
    path = tmp_path / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})


def _renamed(tensors, name_part, fn):
    return {n: (fn(v) if name_part in n else v) for n, v in tensors.items()}


@pytest.mark.parametrize("case,edit,error,code,needle", [
    ("kimi-k2-thinking-int4", lambda t: _renamed(t, "experts.3.up_proj.weight_packed", lambda v: v.view(torch.uint8)),
     QuantTensorDTypeError, "LOAD005", r"experts\.3\.up_proj\.weight_packed.*stored as U8.*I32"),
    ("kimi-k3-mxfp4", lambda t: _renamed(t, "experts.0.w2.weight_scale", lambda v: v.to(torch.bfloat16)),
     QuantTensorDTypeError, "LOAD005", r"w2\.weight_scale.*BF16"),
    ("kimi-k2-instruct-fp8", lambda t: _renamed(t, "experts.1.down_proj.weight_scale_inv", lambda v: v[:, :0]),
     QuantTensorShapeError, "LOAD006", r"down_proj\.weight_scale_inv.*shape \[1, 0\], expected \[1, 1\]"),
    ("kimi-k3-mxfp4", lambda t: _renamed(t, "experts.2.w1.weight_packed", lambda v: v[:, :8].contiguous()),
     QuantTensorShapeError, "LOAD006", r"w1\.weight_packed.*\[32, 8\], expected \[32, 16\]"),
    ("kimi-k2-thinking-int4", lambda t: _renamed(t, "experts.0.gate_proj.weight_shape",
                                                 lambda v: torch.tensor([32, 128], dtype=torch.int32)),
     QuantTensorShapeError, "LOAD006", r"weight_shape.*\[32, 128\].*\[32, 64\]"),
    ("kimi-k2-thinking-int4", lambda t: {n: v for n, v in t.items() if n != "model.layers.1.mlp.experts.5.down_proj.weight_scale"},
     MissingScaleError, "LOAD007", r"experts\.5\.down_proj\.weight_packed.*no scale"),
    ("kimi-k3-mxfp4", lambda t: _renamed(t, "experts.4.w3.weight_scale", lambda v: v.index_fill(-1, torch.tensor([0]), 239)),
     QuantTensorValueError, "LOAD015", r"experts\.4\.w3\.weight_scale.*byte 239, above 238"),
])
def test_bad_quantized_tensors_are_coded(tmp_path, case, edit, error, code, needle):
    cfg, _ = _write(tmp_path, case)
    _edit(tmp_path, edit)
    with pytest.raises(error, match=needle) as info:
        load_quantized_experts(tmp_path, cfg, LAYER, progress=False)
    assert info.value.code == code


def test_unknown_quant_method_and_plain_checkpoints_are_load008(tmp_path):
    cfg, _ = _write(tmp_path, "kimi-k2-thinking-int4")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedQuantizationError, match="group_size") as info:
        load_quantized_experts(tmp_path, cfg, LAYER, progress=False)
    assert info.value.code == "LOAD008"
    plain = tmp_path / "plain"
    write_synthetic_checkpoint(plain, preset("tiny-kimi-k2"), layer_idx=LAYER)
    with pytest.raises(UnsupportedQuantizationError, match="no quantization_config.*load_moe_weights"):
        load_quantized_experts(plain, preset("tiny-kimi-k2"), LAYER, progress=False)


def test_fp8_blocks_need_f_multiple_of_128(tmp_path):
    cfg, _ = _write(tmp_path, "kimi-k2-instruct-fp8")
    with pytest.raises(FP8AlignmentError, match="% 128"):
        load_quantized_experts(tmp_path, dataclasses.replace(cfg, intermediate_size=96), LAYER, progress=False)


# --- bad files: every loader path, plain and quantized ----------------------------------------------

@pytest.fixture
def sharded(tmp_path):
    cfg, _ = _write(tmp_path, "kimi-k2-thinking-int4", num_shards=2)
    return cfg, tmp_path


def _index(path):
    return path / "model.safetensors.index.json"


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not a JSON object"), ("[1, 2]", "not a JSON object"),
    ('{"metadata": {}}', "'weight_map' must map"), ('{"weight_map": {"a": 3}}', "'weight_map' must map"),
])
def test_corrupt_index_is_load012(sharded, content, needle):
    cfg, path = sharded
    _index(path).write_text(content)
    for load in (lambda: load_quantized_experts(path, cfg, LAYER, progress=False),
                 lambda: load_moe_weights(path, cfg, LAYER)):
        with pytest.raises(CorruptIndexError, match=needle) as info:
            load()
        assert info.value.code == "LOAD012"


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/hostname", "sub/../../x.safetensors"])
def test_index_paths_outside_the_folder_are_load013(sharded, shard):
    cfg, path = sharded
    index = json.loads(_index(path).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = shard
    _index(path).write_text(json.dumps(index))
    with pytest.raises(UnsafeShardPathError, match="outside the checkpoint folder") as info:
        load_moe_weights(path, cfg, LAYER)
    assert info.value.code == "LOAD013"


def test_a_shard_linked_outside_the_folder_loads_as_the_hub_cache_keeps_it(sharded, tmp_path_factory):
    """The index names a file inside the folder; that the file is a link into a blob store (the hub cache's
    layout) is no reason to refuse it: LOAD013 judges the index's names, not where links point."""
    cfg, path = sharded
    before = load_quantized_experts(path, cfg, LAYER, progress=False)
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "shard.safetensors"
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    after = load_quantized_experts(path, cfg, LAYER, progress=False)
    assert shard.is_symlink() and len(before.tensors()) == len(after.tensors()) == 4
    assert all(torch.equal(a, b) for a, b in zip(before.tensors(), after.tensors()))


def test_missing_shard_is_load011(sharded):
    cfg, path = sharded
    sorted(path.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(MissingShardError, match=r"missing: \['model-00002-of-00002\.safetensors'\]") as info:
        load_quantized_experts(path, cfg, LAYER, progress=False)
    assert info.value.code == "LOAD011"


@pytest.mark.parametrize("damage", ["truncated", "random", "empty"])
@pytest.mark.parametrize("sharded_layout", [False, True])
def test_truncated_or_random_files_are_load010(tmp_path, damage, sharded_layout):
    cfg, _ = _write(tmp_path, "kimi-k3-mxfp4", num_shards=2 if sharded_layout else 1)
    file = sorted(tmp_path.glob("*.safetensors"))[-1]
    data = file.read_bytes()
    file.write_bytes({"truncated": data[:len(data) * 2 // 3], "random": torch.randint(0, 256, (999,),
                      generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes(),
                      "empty": b""}[damage])
    for load in (lambda: load_quantized_experts(tmp_path, cfg, LAYER, progress=False),
                 lambda: load_moe_weights(tmp_path, cfg, LAYER, experts=False)):
        with pytest.raises(CorruptSafetensorsError, match=file.name) as info:
            load()
        assert info.value.code == "LOAD010"


# --- a whole block from a quantized checkpoint (what MegaMoE.load_hf_weights will compose) ------------------------

def _routed_over_ranks(ranks, expert_width):
    """Routed step of one process over per-rank quantized experts: each slot's row goes to its owner's pool
    (expert-major, the backend's alignment), results are summed in slot order in fp32 (as the reference)."""
    def routed(x_TD, topk_ids_TK, topk_weights_TK):
        num_tokens, num_topk = topk_ids_TK.shape
        out_KTD = torch.zeros(num_topk, num_tokens, expert_width, dtype=x_TD.dtype)
        for experts, first, count in ranks:
            tok, slot = ((topk_ids_TK >= first) & (topk_ids_TK < first + count)).nonzero(as_tuple=True)
            local = topk_ids_TK[tok, slot] - first
            order = torch.argsort(local, stable=True)
            tok, slot, local = tok[order], slot[order], local[order]
            counts = torch.bincount(local, minlength=count)
            layout = ExpertLayout.from_counts(counts, alignment=experts.segment_alignment)
            rank_in_expert = torch.arange(local.numel()) - (torch.cumsum(counts, 0) - counts)[local]
            pos = layout.row_start_e[local] + rank_in_expert
            pool = torch.zeros(layout.num_pool_rows, expert_width, dtype=x_TD.dtype)
            pool[pos] = x_TD[tok]
            out_KTD[slot, tok] = experts(pool, layout)[pos]
        y_TD = torch.zeros(num_tokens, expert_width)
        for k in range(num_topk):
            live = topk_ids_TK[:, k] >= 0
            y_TD += torch.where(live[:, None], topk_weights_TK[:, k, None] * out_KTD[k].float(), 0.0)
        return y_TD.to(x_TD.dtype)
    return routed


@pytest.mark.parametrize("case", ["kimi-k3-mxfp4", "kimi-k2-thinking-int4", "deepseek-v3-fp8"])
def test_whole_block_from_a_quantized_checkpoint_on_two_ranks(tmp_path, case):
    from moe_ref.reference import moe_block, reference_moe

    cfg = _cfg(case)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, quant=CASES[case][1], seed=9,
                                         dtype=torch.float32, num_shards=2)
    count = cfg.num_experts // 2
    ranks = []
    for rank in range(2):
        q = load_quantized_experts(tmp_path, cfg, LAYER, (rank * count, count), progress=False)
        ranks.append((make_quantized_experts(q, cfg.activation, cfg.situ_beta, cfg.situ_linear_beta), rank * count,
                      count))
    # router, bias, latent as stored; shared experts in the precision quantization_config decides (fp8: FP8,
    # dequantized once here; compressed-tensors: ignored, bf16)
    dense = load_moe_weights(tmp_path, cfg, LAYER, experts=False, quant=checkpoint_quant_spec(tmp_path))
    assert dense.num_held_experts == 0
    x = torch.randn(24, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    y = moe_block(x, dense, cfg, _routed_over_ranks(ranks, cfg.expert_hidden_size))
    y_ref = reference_moe(x, written, cfg)
    assert calc_diff(y, y_ref) <= 1e-9, calc_diff(y, y_ref)


def test_backend_choice_and_names():
    from moe_ref.core.errors import UnknownNameError
    from moe_ref.experts.quantized import FP8BlockExperts, W4A16Experts, quantized_experts_class

    assert quantized_experts_class("mxfp4") is QuantTorchExperts  # auto on CPU
    assert quantized_experts_class("mxfp4", device="cuda") is W4A16Experts
    assert quantized_experts_class("int4_group", "triton") is W4A16Experts
    assert quantized_experts_class(QuantFormat.FP8_BLOCK, "auto", "cuda") is FP8BlockExperts
    assert W4A16Experts.segment_alignment == 1 and not W4A16Experts.accepts_fp8_input
    with pytest.raises(UnknownNameError, match="marlin"):
        quantized_experts_class("mxfp4", "marlin")
