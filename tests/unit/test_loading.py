"""Checkpoint loading: round trips per family/layout/sharding, partial reads per EP rank, coded errors."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_ref.checkpoint.reader as reader
from moe_ref.core.config import MoEConfig, preset
from moe_ref.core.errors import (
    CheckpointError,
    InvalidConfigError,
    LayerIndexError,
    MissingTensorError,
    TensorShapeMismatchError,
    UnexpectedTensorError,
    explain,
)
from moe_ref.checkpoint.loading import UnsupportedCheckpointError, check_moe_layer, load_moe_weights
from moe_ref.core.errors import CheckpointNotFoundError
from moe_ref.checkpoint.synthetic import write_synthetic_checkpoint
from moe_ref.core.weights import MoEWeights

pytestmark = pytest.mark.unit

TINY = ("tiny-deepseek-v3", "tiny-kimi-k2", "tiny-kimi-k3", "tiny-step3")
LAYOUTS = {"tiny-deepseek-v3": ("hub", "fused"), "tiny-kimi-k2": ("hub", "fused"), "tiny-kimi-k3": ("hub",),
           "tiny-step3": ("hub",)}
CASES = [(name, layout) for name in TINY for layout in LAYOUTS[name]]
LAYER = 2


def assert_weights_equal(actual: MoEWeights, expected: MoEWeights, **case) -> None:
    for field in dataclasses.fields(MoEWeights):
        a, e = getattr(actual, field.name), getattr(expected, field.name)
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{field.name} is None; {case}"
            assert a.dtype == e.dtype and a.shape == e.shape, f"{field.name}: {a.dtype}{tuple(a.shape)} != " \
                                                              f"{e.dtype}{tuple(e.shape)}; {case}"
            assert torch.equal(a, e), f"{field.name} differs; {case}"
        else:
            assert a == e, f"{field.name}: {a!r} != {e!r}; {case}"


def rewrite(ckpt_dir, edit) -> None:
    """Apply ``edit(tensors) -> tensors`` to a single-file checkpoint."""
    path = ckpt_dir / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})


# --- round trips -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("name,layout", CASES)
def test_round_trip_every_family_layout_and_sharding(tmp_path, name, layout, num_shards):
    cfg = preset(name)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=LAYER, layout=layout, num_shards=num_shards, seed=3)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) == num_shards and (tmp_path / "model.safetensors.index.json").exists() == (num_shards > 1)

    cfg_read = MoEConfig.from_hf_config(tmp_path)  # the written config.json reads back as the same block
    assert dataclasses.replace(cfg_read, name=cfg.name) == cfg
    assert cfg_read.is_moe_layer(LAYER) and not cfg_read.is_moe_layer(LAYER - 1), cfg_read.moe_layers

    loaded = load_moe_weights(tmp_path, cfg_read, LAYER)
    assert_weights_equal(loaded, written, name=name, layout=layout, num_shards=num_shards)
    assert loaded.gate_up_weight_E2FD.dtype == torch.bfloat16  # the writer's default dtype, kept
    assert (loaded.bias_E is None) == (not cfg.use_selection_bias)


def test_single_file_path_and_glob_folder_load(tmp_path):
    cfg = preset("tiny-kimi-k2")
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    assert_weights_equal(load_moe_weights(tmp_path / "model.safetensors", cfg, 0), written)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights-a.safetensors")  # no index, other name
    assert_weights_equal(load_moe_weights(tmp_path, cfg, 0), written)


def test_written_names_are_the_families_real_names(tmp_path):
    """Hard-coded here, independent of ``loading.layer_names`` (a shared naming bug would pass round trips)."""
    E = 16  # tiny DeepSeek-V3 / Kimi-K2 / Kimi-K3
    k3 = "language_model.layers.1.block_sparse_moe."
    expected = {  # (preset, layout): (sample of names, total number of tensors)
        ("tiny-kimi-k2", "hub"): ({"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                                   "model.layers.1.mlp.experts.15.gate_proj.weight",
                                   "model.layers.1.mlp.experts.0.up_proj.weight",
                                   "model.layers.1.mlp.experts.7.down_proj.weight",
                                   "model.layers.1.mlp.shared_experts.gate_proj.weight",
                                   "model.layers.1.mlp.shared_experts.up_proj.weight",
                                   "model.layers.1.mlp.shared_experts.down_proj.weight"}, 2 + 3 * E + 3),
        ("tiny-deepseek-v3", "fused"): ({"model.layers.1.mlp.gate.weight",
                                         "model.layers.1.mlp.gate.e_score_correction_bias",
                                         "model.layers.1.mlp.experts.gate_up_proj",
                                         "model.layers.1.mlp.experts.down_proj",
                                         "model.layers.1.mlp.shared_experts.gate_proj.weight",
                                         "model.layers.1.mlp.shared_experts.up_proj.weight",
                                         "model.layers.1.mlp.shared_experts.down_proj.weight"}, 7),
        ("tiny-kimi-k3", "hub"): ({k3 + n for n in (
            "gate.weight", "gate.e_score_correction_bias", "experts.0.w1.weight", "experts.15.w2.weight",
            "experts.3.w3.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
            "shared_experts.down_proj.weight", "routed_expert_down_proj.weight", "routed_expert_up_proj.weight",
            "routed_expert_norm.weight")}, 2 + 3 * E + 3 + 3),
        ("tiny-step3", "hub"): ({"model.layers.1.moe.gate.weight", "model.layers.1.moe.gate_proj.weight",
                                 "model.layers.1.moe.up_proj.weight", "model.layers.1.moe.down_proj.weight",
                                 "model.layers.1.share_expert.gate_proj.weight",
                                 "model.layers.1.share_expert.up_proj.weight",
                                 "model.layers.1.share_expert.down_proj.weight"}, 7),
    }
    stored = {}
    for (name, layout), (names, total) in expected.items():
        out = tmp_path / f"{name}-{layout}"
        write_synthetic_checkpoint(out, preset(name), layer_idx=1, layout=layout)
        stored[name] = load_file(str(out / "model.safetensors"))
        assert names <= set(stored[name]), f"{name=} {layout=}: missing {sorted(names - set(stored[name]))}"
        assert len(stored[name]) == total, f"{name=} {layout=}: {sorted(set(stored[name]) - names)[:6]} ..."
    # orientation: w1 (gate) of expert e = canonical rows [0, F), w3 (up) = rows [F, 2F), w2 = down
    cfg = preset("tiny-kimi-k3")
    written = write_synthetic_checkpoint(tmp_path / "again", cfg, layer_idx=1)
    F = cfg.intermediate_size
    assert torch.equal(stored["tiny-kimi-k3"][k3 + "experts.5.w1.weight"], written.gate_up_weight_E2FD[5, :F])
    assert torch.equal(stored["tiny-kimi-k3"][k3 + "experts.5.w3.weight"], written.gate_up_weight_E2FD[5, F:])
    assert torch.equal(stored["tiny-kimi-k3"][k3 + "experts.5.w2.weight"], written.down_weight_EDF[5])
    s3 = preset("tiny-step3")
    assert stored["tiny-step3"]["model.layers.1.moe.gate_proj.weight"].shape == \
        (s3.num_experts, s3.intermediate_size, s3.hidden_size)
    assert stored["tiny-step3"]["model.layers.1.moe.down_proj.weight"].shape == \
        (s3.num_experts, s3.hidden_size, s3.intermediate_size)


# --- partial reads (one EP rank's experts) ---------------------------------------------------------------

class _Recorder:
    """Wraps ``safe_open`` and records every data read: whole tensors and row slices."""

    def __init__(self, real):
        self.real, self.whole, self.sliced = real, [], []

    def __call__(self, *args, **kwargs):
        return _Handle(self.real(*args, **kwargs), self)


class _Handle:
    def __init__(self, handle, recorder):
        self.handle, self.recorder = handle, recorder

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        self.recorder.whole.append(name)
        return self.handle.get_tensor(name)

    def get_slice(self, name):
        return _Slice(self.handle.get_slice(name), name, self.recorder)


class _Slice:
    def __init__(self, sl, name, recorder):
        self.sl, self.name, self.recorder = sl, name, recorder

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, index):
        self.recorder.sliced.append((self.name, index))
        return self.sl[index]


def _is_routed_expert(name: str) -> bool:
    return (".experts." in name and "shared_experts" not in name) or \
        any(name.endswith(f".moe.{p}_proj.weight") for p in ("gate", "up", "down"))


def _expert_id(name: str) -> int | None:
    """Expert number of a per-expert tensor name, None for stacked tensors."""
    match = re.search(r"\.experts\.(\d+)\.", name)
    return int(match.group(1)) if match else None


@pytest.mark.parametrize("name,layout", CASES)
def test_expert_range_reads_only_its_experts(tmp_path, monkeypatch, name, layout):
    cfg = preset(name)
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=1, layout=layout)
    num_ranks = 2
    count = cfg.num_experts // num_ranks
    recorder = _Recorder(reader.safe_open)
    monkeypatch.setattr(reader, "safe_open", recorder)
    parts = []
    for rank in range(num_ranks):
        recorder.whole.clear(), recorder.sliced.clear()
        first = rank * count
        part = load_moe_weights(tmp_path, cfg, 1, expert_range=(first, count))
        assert_weights_equal(part, written.expert_slice(first, count), name=name, layout=layout, rank=rank)
        parts.append(part)

        routed = [n for n in recorder.whole + [n for n, _ in recorder.sliced] if _is_routed_expert(n)]
        per_expert_ids = {_expert_id(n) for n in routed if _expert_id(n) is not None}
        stacked_whole = [n for n in recorder.whole if _is_routed_expert(n) and _expert_id(n) is None]
        assert not stacked_whole, f"{name=} {rank=}: stacked expert tensors read whole: {stacked_whole}"
        for tensor_name, index in recorder.sliced:  # stacked tensors: only this rank's rows
            assert index == slice(first, first + count), f"{tensor_name} read with {index}"
        if layout == "hub" and name != "tiny-step3":  # per-expert tensors
            assert per_expert_ids == set(range(first, first + count)), f"{name=} {rank=}: {sorted(per_expert_ids)}"
            assert not recorder.sliced
        else:  # fused: gate_up + down; Step3: gate + up + down, each as one row slice
            assert len(recorder.sliced) == (2 if layout == "fused" else 3) and not per_expert_ids
    whole = torch.cat([p.gate_up_weight_E2FD for p in parts]), torch.cat([p.down_weight_EDF for p in parts])
    assert torch.equal(whole[0], written.gate_up_weight_E2FD) and torch.equal(whole[1], written.down_weight_EDF)


def test_expert_range_needs_no_other_experts_in_the_checkpoint(tmp_path):
    cfg = preset("tiny-kimi-k2")
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    keep = range(8, 12)
    rewrite(tmp_path, lambda t: {n: v for n, v in t.items()
                                 if ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) in keep})
    part = load_moe_weights(tmp_path, cfg, 0, expert_range=(8, 4))
    assert_weights_equal(part, written.expert_slice(8, 4))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight"):
        load_moe_weights(tmp_path, cfg, 0)


@pytest.mark.parametrize("name,layout", [("tiny-kimi-k2", "hub"), ("tiny-kimi-k2", "fused"), ("tiny-step3", "hub")])
def test_progress_bar_over_the_experts_read(tmp_path, capsys, name, layout):
    cfg = preset(name)
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=1, layout=layout)
    load_moe_weights(tmp_path, cfg, 1, expert_range=(0, cfg.num_experts // 2), progress=True)
    err = capsys.readouterr().err
    assert "layer 1 experts" in err and f"/{cfg.num_experts // 2} " in err, err
    load_moe_weights(tmp_path, cfg, 1)  # off by default for the plain loader (MegaMoE turns it on for rank 0)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("expert_range", [(-1, 4), (0, 0), (14, 4)])
def test_expert_range_outside_the_experts_is_a_config_error(tmp_path, expert_range):
    cfg = preset("tiny-kimi-k2")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    with pytest.raises(InvalidConfigError, match=r"expert_range=\(first=.*16 experts") as info:
        load_moe_weights(tmp_path, cfg, 0, expert_range=expert_range)
    assert info.value.code == "CFG007"


# --- dtypes ----------------------------------------------------------------------------------------------

def test_bf16_checkpoint_loaded_into_fp32_and_bias_stays_fp32(tmp_path):
    cfg = preset("tiny-kimi-k3")
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0, dtype=torch.bfloat16)
    bias_name = "language_model.layers.0.block_sparse_moe.gate.e_score_correction_bias"
    rewrite(tmp_path, lambda t: {**t, bias_name: t[bias_name].bfloat16()})  # the real K3 stores it in bf16
    loaded = load_moe_weights(tmp_path, cfg, 0, dtype=torch.float32)
    for field in dataclasses.fields(MoEWeights):
        value, ref = getattr(loaded, field.name), getattr(written, field.name)
        if isinstance(ref, torch.Tensor):
            assert value.dtype == torch.float32, field.name
            expected = ref.bfloat16().float()  # exact: every bf16 value is an fp32 value
            assert torch.equal(value, expected), field.name
    as_bf16 = load_moe_weights(tmp_path, cfg, 0, dtype=torch.bfloat16)
    assert as_bf16.bias_E.dtype == torch.float32 and as_bf16.gate_up_weight_E2FD.dtype == torch.bfloat16


def test_non_float_dtype_argument_is_refused(tmp_path):
    cfg = preset("tiny-step3")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    with pytest.raises(TypeError, match="not a floating dtype"):
        load_moe_weights(tmp_path, cfg, 0, dtype=torch.int8)


# --- errors ----------------------------------------------------------------------------------------------

def test_missing_router_of_a_dense_layer_names_tensor_layer_files_and_moe_layers(tmp_path):
    cfg_written = preset("tiny-deepseek-v3")
    write_synthetic_checkpoint(tmp_path, cfg_written, layer_idx=3, num_shards=2)
    cfg = MoEConfig.from_hf_config(tmp_path)  # knows layers 0-2 are dense
    with pytest.raises(MissingTensorError) as info:
        load_moe_weights(tmp_path, cfg, 1)
    msg = str(info.value)
    assert info.value.code == "LOAD001" and msg.startswith("[LOAD001]")
    assert "'model.layers.1.mlp.gate.weight'" in msg and "layer 1" in msg
    assert "model-00001-of-00002.safetensors" in msg and "2 file(s)" in msg
    assert "Layer 1 is a dense layer" in msg and "MoE layers are 3" in msg
    assert "for layers 3" in msg  # what the checkpoint itself holds
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert info.value.details["name"] == "model.layers.1.mlp.gate.weight" and info.value.details["layer"] == 1


def test_missing_tensor_under_another_prefix_suggests_the_prefix(tmp_path):
    cfg = preset("tiny-step3")
    written = write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    rewrite(tmp_path, lambda t: {n.replace("model.layers.", "model.language_model.layers."): v for n, v in t.items()})
    assert_weights_equal(load_moe_weights(tmp_path, cfg, 0), written)  # auto-detected
    with pytest.raises(MissingTensorError, match=r"pass prefix='model\.language_model\.layers\.'"):
        load_moe_weights(tmp_path, cfg, 0, prefix="model.layers.")


def test_missing_single_tensor_is_named_with_similar_names(tmp_path):
    cfg = preset("tiny-kimi-k2")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    gone = "model.layers.0.mlp.shared_experts.down_proj.weight"
    rewrite(tmp_path, lambda t: {n: v for n, v in t.items() if n != gone})
    with pytest.raises(MissingTensorError, match=rf"'{gone}'.*Similar names.*shared_experts\.(gate|up)_proj"):
        load_moe_weights(tmp_path, cfg, 0)


def test_other_family_checkpoint_missing_experts_lists_the_layouts_tried(tmp_path):
    write_synthetic_checkpoint(tmp_path, preset("tiny-step3"), layer_idx=0)
    cfg = dataclasses.replace(preset("tiny-kimi-k2"), num_experts=8, num_topk=3)
    with pytest.raises(MissingTensorError) as info:
        load_moe_weights(tmp_path, cfg, 0)
    msg = str(info.value)
    assert "'model.layers.0.mlp.gate.weight'" in msg and "'model.layers.0.moe.gate.weight' (Step3 naming)" in msg
    assert "is the config's family (kimi_k2) right?" in msg, msg


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    cfg = preset("tiny-deepseek-v3")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0, layout="fused")
    wrong = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size + 8)
    with pytest.raises(TensorShapeMismatchError) as info:
        load_moe_weights(tmp_path, wrong, 0)
    msg, F, D, E = str(info.value), cfg.intermediate_size, cfg.hidden_size, cfg.num_experts
    assert info.value.code == "LOAD002" and "'model.layers.0.mlp.experts.gate_up_proj'" in msg
    assert f"has shape [{E}, {2 * F}, {D}]" in msg and f"expects [{E}, {2 * F + 16}, {D}]" in msg, msg
    assert info.value.details["found"] == (E, 2 * F, D)


def test_transposed_tensor_is_reported_as_transposed(tmp_path):
    cfg = preset("tiny-kimi-k2")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    name = "model.layers.0.mlp.experts.4.down_proj.weight"
    rewrite(tmp_path, lambda t: {**t, name: t[name].t().contiguous()})
    with pytest.raises(TensorShapeMismatchError, match=rf"'{name}'.*\[{cfg.intermediate_size}, {cfg.hidden_size}\]"
                                                       rf".*looks transposed"):
        load_moe_weights(tmp_path, cfg, 0)


def test_kimi_k3_mxfp4_packed_experts_are_refused_clearly(tmp_path):
    cfg = preset("tiny-kimi-k3")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)

    def pack(tensors):  # the real K3 layout: weight_packed (uint8, 2 fp4 per byte) + per-32 scales
        out = {}
        for name, value in tensors.items():
            if ".experts." in name:
                stem = name[:-len(".weight")]
                out[f"{stem}.weight_packed"] = torch.zeros(value.shape[0], value.shape[1] // 2, dtype=torch.uint8)
                out[f"{stem}.weight_scale"] = torch.zeros(value.shape[0], value.shape[1] // 32 + 1, dtype=torch.uint8)
            else:
                out[name] = value
        return out

    rewrite(tmp_path, pack)
    with pytest.raises(UnsupportedCheckpointError, match=r"experts\.0\.w1\.weight_packed.*MXFP4.*without a "
                                                         r"quantization_config.*restore the quantization_config") as info:
        load_moe_weights(tmp_path, cfg, 0)
    assert info.value.code == "LOAD003" and isinstance(info.value, CheckpointError)
    assert "reads plain" not in str(info.value)  # it reads quantized checkpoints, given their quantization_config
    text = explain("LOAD003")
    assert "MXFP4" in text and "Restore the quantization_config" in text and "not supported" not in text


def test_fp8_weights_with_scales_are_refused_not_misread(tmp_path):
    cfg = preset("tiny-kimi-k2")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    rewrite(tmp_path, lambda t: {**t, name: t[name].to(torch.float8_e4m3fn),
                                 name + "_scale_inv": torch.ones(1, 1, dtype=torch.float32)})
    with pytest.raises(UnsupportedCheckpointError, match=rf"'{name}' has dtype F8_E4M3.*weight_scale_inv"):
        load_moe_weights(tmp_path, cfg, 0)


def test_missing_path_and_missing_shard_are_coded(tmp_path):
    cfg = preset("tiny-kimi-k2")
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as info:
        load_moe_weights(tmp_path / "nope", cfg, 0)
    assert info.value.code == "LOAD004" and isinstance(info.value, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"holds no \*\.safetensors"):
        load_moe_weights(tmp_path / "empty", cfg, 0)
    write_synthetic_checkpoint(tmp_path / "sharded", cfg, layer_idx=0, num_shards=2)
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"missing: \['model-00002-of-00002\.safetensors'\]"):
        load_moe_weights(tmp_path / "sharded", cfg, 0)
    assert json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["metadata"]["total_size"] > 0


def test_writer_refuses_layouts_a_family_does_not_have(tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match=r"layout='fused' does not exist for family 'kimi_k3'"):
        write_synthetic_checkpoint(tmp_path, preset("tiny-kimi-k3"), layout="fused")
    with pytest.raises(InvalidConfigError, match="num_shards=99"):
        write_synthetic_checkpoint(tmp_path, preset("tiny-step3"), num_shards=99)


# --- layer indices, stray biases, and the header-only check ----------------------------------------------------------

def test_a_layer_past_the_last_is_named_so_not_called_dense(tmp_path):
    write_synthetic_checkpoint(tmp_path, preset("tiny-kimi-k2"), layer_idx=2)
    cfg = MoEConfig.from_hf_config(tmp_path)  # its config.json: 3 layers, 0-1 dense, 2 the MoE layer
    assert (cfg.num_layers, cfg.moe_layers) == (3, (2,))
    with pytest.raises(LayerIndexError, match=r"layer 99 is past the model's last layer: .*num_hidden_layers=3 "
                                              r"\(layers 0\.\.2\); its MoE layers are 2") as info:
        load_moe_weights(tmp_path, cfg, 99)
    assert info.value.code == "LOAD018" and "dense" not in str(info.value)
    with pytest.raises(LayerIndexError, match="layer -1 is not a layer of the model"):
        load_moe_weights(tmp_path, cfg, -1)
    with pytest.raises(MissingTensorError, match="Layer 1 is a dense layer in this config; its MoE layers are 2"):
        load_moe_weights(tmp_path, cfg, 1)


def test_a_bias_the_family_has_no_place_for_is_refused(tmp_path):
    cfg = preset("tiny-kimi-k2")
    write_synthetic_checkpoint(tmp_path, cfg, layer_idx=0)
    name = "model.layers.0.mlp.shared_experts.down_proj.bias"
    rewrite(tmp_path, lambda t: {**t, name: torch.zeros(cfg.hidden_size)})
    with pytest.raises(UnexpectedTensorError, match=rf"'{re.escape(name)}' \(layer 0\) is a bias of .*no bias there"
                                                    ) as info:
        load_moe_weights(tmp_path, cfg, 0)
    assert info.value.code == "LOAD019" and isinstance(info.value, CheckpointError)


def test_check_moe_layer_agrees_with_the_loader_without_reading_values(tmp_path, monkeypatch):
    write_synthetic_checkpoint(tmp_path, preset("tiny-kimi-k2"), layer_idx=2)
    cfg = MoEConfig.from_hf_config(tmp_path)
    monkeypatch.setattr(reader.CheckpointReader, "read", lambda *a: pytest.fail("check_moe_layer read a value"))
    monkeypatch.setattr(reader.CheckpointReader, "read_rows", lambda *a: pytest.fail("check_moe_layer read rows"))
    assert check_moe_layer(tmp_path, cfg, 2) == []
    assert [p.code for p in check_moe_layer(tmp_path, cfg, 1)] == ["LOAD001"]  # a dense layer
    assert [p.code for p in check_moe_layer(tmp_path, cfg, 9)] == ["LOAD018"]
    monkeypatch.undo()
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite(tmp_path, lambda t: {k: v for k, v in t.items() if k != name})
    (problem,) = check_moe_layer(tmp_path, cfg, 2)
    with pytest.raises(MissingTensorError) as info:
        load_moe_weights(tmp_path, cfg, 2)
    assert (problem.code, str(problem)) == ("LOAD001", str(info.value)) and name in str(problem)


def test_gpt_oss_own_mxfp4_is_refused_naming_the_way_to_its_plain_weights():
    from moe_ref.checkpoint.formats import quant_spec_from_config
    from moe_ref.core.errors import UnsupportedQuantizationError

    with pytest.raises(UnsupportedQuantizationError, match=r"'mxfp4' is not supported \(gpt-oss's transformers MXFP4"
                                                           r".*Mxfp4Config\(dequantize=True\)") as info:
        quant_spec_from_config({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}})
    assert info.value.code == "LOAD008"
