"""moe_ref.bench.peers (scripts/peer_moe.py's reader): the routing inputs it builds from our layout, the tuned-config
file names and lookup, the default rule, the kernel extraction and the fused-moe zip, on fake wheels written to
tmp_path; then the real engines' kernels under TRITON_INTERPRET=1 vs our twin, and vLLM's rules as read from its file
in .whl/ (skipped, with the reason, when `make peers` has not put the file there)."""

import json
import pathlib
import zipfile

import pytest
import torch

import moe_ref.bench.peers as pm
from moe_ref.core.errors import BackendUnavailableError
from moe_ref.experts import ExpertLayout

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------------------
# routing inputs
# ------------------------------------------------------------------------------------------------
def test_routing_worked_example():
    routing = pm.peer_routing(torch.tensor([0, 4, 4]), torch.tensor([3, 0, 5], dtype=torch.int32), 12, 4, pm.SGLANG)
    assert routing.sorted_token_ids.tolist() == [0, 1, 2, 12, 4, 5, 6, 7, 8, 12, 12, 12] + [12] * 8
    assert routing.expert_ids.tolist() == [0, 2, 2, -1, -1]
    vllm = pm.peer_routing(torch.tensor([0, 4, 4]), torch.tensor([3, 0, 5], dtype=torch.int32), 12, 4, pm.VLLM)
    assert vllm.sorted_token_ids.tolist() == [0, 1, 2, 12, 4, 5, 6, 7, 8, 12, 12, 12] + [12] * 5  # 8 + 3 * 3 ids
    assert vllm.expert_ids.tolist() == [0, 2, 2, -1, -1]
    assert routing.num_tokens_post_padded.tolist() == [12]
    assert routing.row_expert_P.tolist() == [0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, -1]
    assert routing.num_valid_tokens == 12 and routing.block_m == 4
    assert routing.sorted_token_ids.dtype == routing.expert_ids.dtype == torch.int32


def _engine_buffer_size(engine, routed, num_experts, block_m):
    """The sorted_token_ids length of each engine's moe_align_block_size (read from their sources)."""
    if engine is pm.SGLANG:  # int4-padded
        size = routed * block_m if routed < num_experts + 1 else routed + (num_experts + 1) * (block_m - 1)
        return (size + 3) // 4 * 4
    size = routed + num_experts * (block_m - 1)
    return min(routed * block_m, size) if routed < num_experts else size


def _check_routing(counts, block_m, alignment, engine):
    layout = ExpertLayout.from_counts(torch.tensor(counts), alignment)
    num_pool_rows = layout.num_pool_rows + alignment
    routing = pm.peer_routing(layout.row_start_e, layout.num_rows_e, num_pool_rows, block_m, engine)
    ids, experts = routing.sorted_token_ids.tolist(), routing.expert_ids.tolist()
    routed, num_experts = sum(counts), len(counts)
    assert len(ids) == _engine_buffer_size(engine, routed, num_experts, block_m), counts
    assert len(experts) == -(-len(ids) // block_m)
    padded = sum(-(-c // block_m) * block_m for c in counts)
    assert routing.num_tokens_post_padded.tolist() == [padded], counts
    assert len(ids) >= padded
    seen = []
    for block in range(padded // block_m):  # every used block: one expert, its rows in order, then sentinels
        expert = experts[block]
        start, count = layout.row_start_e[expert].item(), counts[expert]
        rows = [r for r in ids[block * block_m:(block + 1) * block_m] if r != num_pool_rows]
        assert rows and all(start <= r < start + count for r in rows), (counts, block)
        seen += rows
    assert seen == [r for s, c in zip(layout.row_start_e.tolist(), counts) for r in range(s, s + c)]
    assert all(r == num_pool_rows for r in ids[padded:])
    assert all(e == -1 for e in experts[padded // block_m:])
    blocks_of = [experts[:padded // block_m].count(i) for i in range(num_experts)]
    assert blocks_of == [-(-c // block_m) for c in counts], counts
    expected_row_expert = layout.row_expert_P().tolist() + [-1] * alignment
    assert routing.row_expert_P.tolist() == expected_row_expert


@pytest.mark.parametrize("counts", [
    [5, 0, 19],            # uneven, an empty expert
    [16, 17, 0, 1],        # rows == BLOCK_M, BLOCK_M + 1, one row
    [0, 0, 0, 33],         # all rows in the last expert
    [1, 2],                # fewer routed rows than experts + 1: the small-batch buffer size
    [0, 0],                # nothing routed
])
@pytest.mark.parametrize("engine", [pm.SGLANG, pm.VLLM], ids=lambda engine: engine.name)
def test_routing_matches_align_block_size_layout(counts, engine):
    _check_routing(counts, block_m=16, alignment=16, engine=engine)
    _check_routing(counts, block_m=16, alignment=128, engine=engine)  # our alignment: padding rows between segments


@pytest.mark.parametrize("engine", [pm.SGLANG, pm.VLLM], ids=lambda engine: engine.name)
def test_routing_of_a_bigger_random_layout(engine):
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, 12, (300,), generator=gen), minlength=12).tolist()
    counts[3] = 0
    _check_routing(counts, block_m=64, alignment=128, engine=engine)


# ------------------------------------------------------------------------------------------------
# config files and the default rule, on a fake wheel
# ------------------------------------------------------------------------------------------------
_DEFAULT_RULE = '''
from sglang.srt.runtime_context import get_exec   # not importable here: the reader runs the function alone

_is_hip = True


def get_default_config(M: int, E: int, N: int, K: int, topk: int, dtype: Optional[str], is_marlin: bool,
                       block_shape: Optional[List[int]] = None) -> Dict[str, int]:
    if get_exec().deterministic.enable_deterministic_inference or _is_hip or _use_low_smem_fp8_default():
        return {"BLOCK_SIZE_M": -1}
    return {"BLOCK_SIZE_M": 16 if M <= E else 64, "BLOCK_SIZE_N": N, "BLOCK_SIZE_K": K, "dtype": dtype,
            "block": block_shape, "topk": topk}
'''


def _tile(block_m, marker):
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "marker": marker}


def _fake_wheel(tmp_path, files: dict, name="sglang-9.9.9-py3-none-any.whl") -> str:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as archive:
        for member, content in files.items():
            archive.writestr(member, content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _config_wheel(tmp_path) -> str:
    cfg = pm.SGLANG.configs
    bf16 = "E=4,N=256,device_name=NVIDIA_H200"
    fp8 = "E=4,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128]"
    return _fake_wheel(tmp_path, {
        pm.SGLANG.rule: _DEFAULT_RULE,
        f"{cfg}/triton_3_1_0/{bf16}.json": {"1": _tile(16, "3.1 small"), "64": _tile(64, "3.1 big")},
        f"{cfg}/triton_3_6_0/{bf16}.json": {"1": _tile(16, "3.6 small"), "64": _tile(64, "3.6 big")},
        f"{cfg}/triton_3_10_0/{bf16}.json": {"1": _tile(16, "3.10 small"), "256": _tile(128, "3.10 big")},
        f"{cfg}/triton_3_10_0/{bf16}_down.json": {"1": {**_tile(32, "3.10 down"), "USE_TMA": True}},
        f"{cfg}/triton_3_1_0/{fp8}.json": {"8": {**_tile(16, "fp8"), "USE_TMA": True}},
        f"{cfg}/triton_3_1_0/E=9,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json": {},
        f"{cfg}/triton_3_1_0/E=4,N=256,device_name=NVIDIA_H100.json": {},
        f"{cfg}/README.md": "not a folder",
    })


def test_config_file_names_follow_the_engine():
    name = pm.SGLANG.config_file_name
    assert name(48, 2048, "NVIDIA H200", "bf16") == "E=48,N=2048,device_name=NVIDIA_H200.json"
    assert name(48, 2048, "NVIDIA H200", "fp8") == \
        "E=48,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
    assert name(48, 5120, "NVIDIA H200", "fp8", down=True) == \
        "E=48,N=5120,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128]_down.json"
    assert name(8, 512, "NVIDIA H200", "fp32") == "E=8,N=512,device_name=NVIDIA_H200,dtype=float32.json"
    with pytest.raises(ValueError, match="peer dtype"):
        name(8, 512, "NVIDIA H200", "int4")


def test_vllm_config_file_names():
    name = pm.VLLM.config_file_name
    assert name(48, 2048, "NVIDIA H200", "bf16") == "E=48,N=2048,device_name=NVIDIA_H200.json"
    assert name(32, 2048, "NVIDIA H200", "fp8") == \
        "E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"  # no space in the block
    assert name(8, 512, "NVIDIA H200 NVL", "fp32") == "E=8,N=512,device_name=NVIDIA_H200,dtype=float32.json"
    assert name(8, 512, "NVIDIA H100 80GB HBM3", "fp16") == "E=8,N=512,device_name=NVIDIA_H100_80GB_HBM3.json"
    assert name(8, 512, "AMD Instinct MI300X / OAM", "bf16") == "E=8,N=512,device_name=AMD_Instinct_MI300X_OAM.json"
    with pytest.raises(ValueError, match="no _down"):
        name(8, 512, "NVIDIA H200", "bf16", down=True)


def test_config_folder_search_order(tmp_path):
    wheel = _config_wheel(tmp_path)
    name = pm.SGLANG.config_file_name(4, 256, "NVIDIA H200", "bf16")
    assert pm.find_config_file(wheel, name, "3.6.0").split("/")[-2] == "triton_3_6_0"  # the running Triton's
    assert pm.find_config_file(wheel, name, "3.6.0+git1234").split("/")[-2] == "triton_3_6_0"
    assert pm.find_config_file(wheel, name, "3.7.0").split("/")[-2] == "triton_3_10_0"  # else newest (not '3_1')
    assert pm.find_config_file(wheel, pm.SGLANG.config_file_name(5, 256, "NVIDIA H200", "bf16"), "3.6.0") is None


def test_tuned_config_nearest_batch_key_and_down_file(tmp_path):
    wheel = _config_wheel(tmp_path)
    small = pm.peer_config(wheel, 4, 256, "bf16", "NVIDIA H200", 20, triton_version="3.6.0")
    assert small.up["marker"] == "3.6 small" and small.block_m == 16  # |20 - 1| < |20 - 64|
    # the _down file is searched like the up file (every folder): 3.10's, its BLOCK_SIZE_M forced to GEMM1's
    assert small.down["marker"] == "3.10 down" and small.down["BLOCK_SIZE_M"] == 16
    assert small.source == "triton_3_6_0/E=4,N=256,device_name=NVIDIA_H200.json + " \
                           "E=4,N=256,device_name=NVIDIA_H200_down.json"
    assert pm.peer_config(wheel, 4, 256, "bf16", "NVIDIA H200", 40, triton_version="3.6.0").up["marker"] == "3.6 big"
    # 3.7 takes the 3.10 folder, with its _down file: USE_TMA dropped, BLOCK_SIZE_M forced to GEMM1's
    config = pm.peer_config(wheel, 4, 256, "bf16", "NVIDIA H200", 1000, triton_version="3.7.0")
    assert config.up["marker"] == "3.10 big" and config.down["marker"] == "3.10 down"
    assert config.down["BLOCK_SIZE_M"] == config.up["BLOCK_SIZE_M"] == 128
    assert "USE_TMA" not in config.down and config.source.endswith("_down.json")
    fp8 = pm.peer_config(wheel, 4, 256, "fp8", "NVIDIA H200", 1, triton_version="3.6.0")
    assert fp8.up["marker"] == "fp8" and "USE_TMA" not in fp8.up and fp8.source.startswith("triton_3_1_0/")
    assert fp8.down == fp8.up  # no _down file anywhere: GEMM2 takes GEMM1's config


def test_default_rule_is_read_from_the_wheel(tmp_path):
    wheel = _config_wheel(tmp_path)
    config = pm.peer_config(wheel, 6, 512, "fp8", "NVIDIA H200", 6, hidden=7168, triton_version="3.6.0")
    assert config.source.startswith("default rule")
    # run as SGLang runs it on CUDA: not ROCm (the module's `_is_hip = True` is replaced), no deterministic mode
    assert config.up == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 512, "BLOCK_SIZE_K": 7168, "dtype": "fp8_w8a8",
                         "block": [128, 128], "topk": 1}
    assert config.down == config.up
    assert pm.peer_config(wheel, 6, 512, "bf16", "NVIDIA H200", 7, triton_version="3.6.0").up["BLOCK_SIZE_M"] == 64


def test_tuned_shapes_and_note(tmp_path):
    wheel = _config_wheel(tmp_path)
    assert pm.tuned_shapes(wheel, "NVIDIA H200", "fp8") == [(4, 256, "triton_3_1_0"), (9, 256, "triton_3_1_0")]
    assert pm.tuned_shapes(wheel, "NVIDIA H200", "bf16") == [(4, 256, "triton_3_10_0"), (4, 256, "triton_3_1_0"),
                                                               (4, 256, "triton_3_6_0")]
    note = pm.nearest_tuned(wheel, 48, 256, "NVIDIA H200", "fp8")
    assert "E=48,N=256" in note and "E=4,N=256 (triton_3_1_0), E=9,N=256 (triton_3_1_0)" in note
    assert "no tuned NVIDIA B200" in pm.nearest_tuned(wheel, 48, 256, "NVIDIA B200", "fp8")


# ------------------------------------------------------------------------------------------------
# reading the kernels
# ------------------------------------------------------------------------------------------------
_KERNELS = '''
from sglang.kernels.jit.utils import is_arch_support_pdl   # unimportable here: must not be copied

import triton
import triton.language as tl

SCALE = tl.constexpr(3.0)  # Triton reads a module global inside a kernel only as a constexpr
_UNUSED = object()


@triton.jit
def helper(x):
    return x * SCALE


@triton.jit
def fused_moe_kernel(a_ptr, c_ptr, N, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    offs = tl.arange(0, BLOCK)
    tl.store(c_ptr + offs, helper(tl.load(a_ptr + offs, mask=offs < N, other=0.0)), mask=offs < N)


@triton.jit
def act_and_mul_kernel(x_ptr):
    pass


def not_a_kernel():
    return is_arch_support_pdl()
'''
_QUANT = '''
import triton
import triton.language as tl


@triton.jit
def _per_token_group_quant_8bit(y_ptr):
    pass
'''


def test_kernels_are_read_out_of_the_wheel(tmp_path):
    wheel = _fake_wheel(tmp_path, {pm.SGLANG.kernels: _KERNELS, pm.SGLANG.quant: _QUANT})
    peer = pm.load_peer_kernel(wheel)
    assert (peer.engine, peer.version, peer.label) == (pm.SGLANG, "9.9.9", "sglang 9.9.9")
    assert peer.gemm_params == ("a_ptr", "c_ptr", "N", "BLOCK", "FLAG")
    assert peer.gemm_required == {"a_ptr", "c_ptr", "N", "BLOCK"}
    source = pathlib.Path(peer.module_file).read_text()
    assert not peer.module_file.startswith(str(pathlib.Path(__file__).resolve().parents[1]))  # not in the repo
    assert "SCALE = tl.constexpr(3.0)" in source and "def helper" in source and "@triton.jit\ndef fused_moe_kernel" in source
    assert "sglang" not in source.split('"""')[2] and "_UNUSED" not in source and "not_a_kernel" not in source
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU (tests/conftest.py)
    a = torch.arange(5, dtype=torch.float32, device=device)
    c = torch.zeros(5, device=device)
    peer.gemm[(1,)](a, c, 5, BLOCK=8)
    assert c.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]


def test_missing_wheel_or_function_raises_coded_error(tmp_path):
    with pytest.raises(BackendUnavailableError, match="ENV001.*not found.*make peers"):
        pm.load_peer_kernel(str(tmp_path / "sglang-1.0-py3-none-any.whl"))
    with pytest.raises(BackendUnavailableError, match="not a known engine's wheel"):
        pm.load_peer_kernel(_fake_wheel(tmp_path, {}, name="flashinfer-0.3.0-py3-none-any.whl"))
    with pytest.raises(BackendUnavailableError, match="not named like a wheel"):
        pm.load_peer_kernel(_fake_wheel(tmp_path, {}, name="vllm.zip"))
    with pytest.raises(BackendUnavailableError, match="has no vllm/model_executor/layers/fused_moe/fused_moe.py"):
        pm.load_peer_kernel(_fake_wheel(tmp_path, {}, name="vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl"))
    with pytest.raises(BackendUnavailableError, match="has no sglang/kernels/ops/moe"):
        pm.load_peer_kernel(_fake_wheel(tmp_path, {pm.SGLANG.quant: _QUANT}))
    no_act = _KERNELS.replace("act_and_mul_kernel", "other_kernel")
    with pytest.raises(BackendUnavailableError, match="no module-level 'act_and_mul_kernel'"):
        pm.load_peer_kernel(_fake_wheel(tmp_path, {pm.SGLANG.kernels: no_act, pm.SGLANG.quant: _QUANT},
                                        name="sglang-9.9.8-py3-none-any.whl"))
    not_jit = _KERNELS.replace("@triton.jit\ndef act_and_mul_kernel", "def act_and_mul_kernel")
    with pytest.raises(BackendUnavailableError, match="not a triton.jit function"):
        pm.load_peer_kernel(_fake_wheel(tmp_path, {pm.SGLANG.kernels: not_jit, pm.SGLANG.quant: _QUANT},
                                        name="sglang-9.9.7-py3-none-any.whl"))
    (tmp_path / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    with pytest.raises(BackendUnavailableError, match="not a zip"):
        pm.find_config_file(str(tmp_path / "broken-1.0-py3-none-any.whl"), "x.json", "3.6.0")


def test_default_peer_files_one_per_engine_newest_first(tmp_path):
    assert pm.default_peer_files(str(tmp_path)) == []
    folder = tmp_path / ".whl"
    folder.mkdir()
    for name in ("vllm-0.9.2-fused-moe.zip", "vllm-0.10.0-fused-moe.zip", "sgl_deep_gemm-0.1.4-py3-none-any.whl"):
        (folder / name).write_text("")
    assert [pathlib.Path(p).name for p in pm.default_peer_files(str(tmp_path))] == ["vllm-0.10.0-fused-moe.zip"]
    (folder / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl").write_text("")
    (folder / "vllm-0.10.0-cp38-abi3-manylinux1_x86_64.whl").write_text("")  # the same version: the wheel first
    assert [pathlib.Path(p).name for p in pm.default_peer_files(str(tmp_path))] == [
        "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", "vllm-0.10.0-cp38-abi3-manylinux1_x86_64.whl"]


# ------------------------------------------------------------------------------------------------
# vLLM's config layout and the fused-moe zip, on fake wheels
# ------------------------------------------------------------------------------------------------
_VLLM_RULE = '''
import vllm.envs as envs   # not importable here: the reader runs the function alone


def should_moe_wna16_use_cuda(num_valid_tokens, group_size, num_experts, bit):
    return ops.unknown()


def get_default_config(M, E, N, K, topk, dtype, block_shape=None):
    if envs.VLLM_BATCH_INVARIANT or current_platform.is_rocm():
        return {"BLOCK_SIZE_M": -1}
    if dtype == "int8_w8a16":
        return {"BLOCK_SIZE_M": should_moe_wna16_use_cuda(M, 128, E, 8)}
    return {"BLOCK_SIZE_M": 16 if M <= E else 64, "BLOCK_SIZE_N": N, "BLOCK_SIZE_K": K, "dtype": dtype,
            "block": block_shape, "topk": topk}
'''


def _vllm_wheel(tmp_path) -> str:
    cfg = pm.VLLM.configs
    return _fake_wheel(tmp_path, {
        pm.VLLM.kernels: _VLLM_RULE,
        pm.VLLM.quant: "# the quant kernel",
        pm.VLLM.swap_rule[0]: "def enable_swap_ab(BLOCK_SIZE_M, BLOCK_SIZE_N):\n    return BLOCK_SIZE_M < 64\n",
        f"{cfg}/E=4,N=256,device_name=NVIDIA_H200.json": {"triton_version": "3.4.0", "1": _tile(16, "small"),
                                                           "64": _tile(64, "big")},
        f"{cfg}/E=4,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json": {"8": _tile(16, "fp8")},
        f"{cfg}/README": "not a config",
        "vllm/_C.abi3.so": "a binary the zip leaves out",
    }, name="vllm-9.9.9-cp38-abi3-manylinux1_x86_64.whl")


def test_vllm_tuned_config_is_one_flat_folder_and_serves_both_gemms(tmp_path):
    wheel = _vllm_wheel(tmp_path)
    config = pm.peer_config(wheel, 4, 256, "bf16", "NVIDIA H200 NVL", 40, triton_version="3.6.0")
    assert config.up["marker"] == "big" and config.down == config.up  # "triton_version" is not a batch key
    assert config.source == "E=4,N=256,device_name=NVIDIA_H200.json"
    assert pm.peer_config(wheel, 4, 256, "fp8", "NVIDIA H200", 1, triton_version="3.6.0").up["marker"] == "fp8"
    assert pm.tuned_shapes(wheel, "NVIDIA H200", "fp8") == [(4, 256, "configs")]
    # run on CUDA, not batch invariant; its int4/int8 helper is a stub (the wheel's would need `ops`: unreadable)
    rule = pm.peer_config(wheel, 6, 512, "fp8", "NVIDIA H200", 6, hidden=7168, triton_version="3.6.0")
    assert rule.source.startswith("default rule") and rule.down == rule.up
    assert rule.up == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 512, "BLOCK_SIZE_K": 7168, "dtype": "fp8_w8a8",
                       "block": [128, 128], "topk": 1}


def test_extract_members_copies_only_what_the_reader_opens_byte_for_byte(tmp_path):
    wheel = _vllm_wheel(tmp_path)
    out = pm.extract_members(wheel, str(tmp_path / "out"))
    assert pathlib.Path(out).name == "vllm-9.9.9-fused-moe.zip"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out) as cut:
        assert sorted(cut.namelist()) == sorted(
            [pm.VLLM.kernels, pm.VLLM.quant, pm.VLLM.swap_rule[0]]
            + [n for n in source.namelist() if n.startswith(pm.VLLM.configs) and n.endswith(".json")])
        for member in cut.namelist():
            assert cut.read(member) == source.read(member), member
            assert cut.getinfo(member).date_time == source.getinfo(member).date_time, member
    # the cut reads as the wheel does
    assert pm.peer_config(out, 4, 256, "bf16", "NVIDIA H200", 40, triton_version="3.6.0").up["marker"] == "big"
    with pytest.raises(BackendUnavailableError, match="has no"):
        pm.extract_members(_fake_wheel(tmp_path, {}, name="vllm-9.9.8-cp38-abi3-manylinux1_x86_64.whl"),
                           str(tmp_path / "out"))


# ------------------------------------------------------------------------------------------------
# the real engines, from the files `make peers` puts in .whl/ (the interpreter on CPU, compiled on CUDA)
# ------------------------------------------------------------------------------------------------
def _peer_file(engine_name: str) -> str:
    for path in pm.default_peer_files():
        if pathlib.Path(path).name.startswith(engine_name + "-"):
            return path
    pytest.skip(f"no {engine_name} peer file in .whl/ (`make peers` downloads .whl/sglang-*.whl and builds "
                ".whl/vllm-<version>-fused-moe.zip)")


_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_HIDDEN, _INTER, _ALIGN, _CASES = pm.check_cases(_DEVICE)


@pytest.mark.parametrize("engine_name", ["vllm", "sglang"])
@pytest.mark.parametrize("case", _CASES, ids=[f"{name} {dtype}" for name, _, dtype, _ in _CASES])
def test_real_peer_matches_our_twin(engine_name, case):
    name, counts, dtype, config = case
    peer = pm.load_peer_kernel(_peer_file(engine_name))
    ok, line = pm.check_case(peer, name, counts, _HIDDEN, _INTER, dtype, _DEVICE, _ALIGN, config)
    assert ok, line


def test_vllm_default_rule_from_its_file():
    wheel = _peer_file("vllm")

    def rule(rows, dtype, num_experts=48, inter=2048):
        return pm.peer_config(wheel, num_experts, inter, dtype, "NVIDIA H200", rows, hidden=7168).up

    # block FP8: BLOCK_SIZE_N 64 and 4 stages up to 4 rows, 3 stages up to 8, then N = the 128 block; M 16 up to 64
    assert rule(3, "fp8") == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                              "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
    assert (rule(6, "fp8")["BLOCK_SIZE_N"], rule(6, "fp8")["num_stages"]) == (64, 3)
    assert rule(512, "fp8") == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
                                "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    # bf16: tiles grow with the rows; GROUP_SIZE_M 16 only past 128 rows per expert
    assert rule(64, "bf16") == {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                                "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    assert rule(32768, "bf16") == {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16,
                                   "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
    assert pm.nearest_tuned(wheel, 48, 2048, "NVIDIA H200", "fp8").endswith(
        "nearest: E=8,N=2048 (configs), E=32,N=2048 (configs)")


def test_vllm_tuned_file_from_its_file():
    wheel = _peer_file("vllm")
    name = "E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    table = json.loads(zipfile.ZipFile(wheel).read(f"{pm.VLLM.configs}/{name}"))
    for rows in (1, 100, 5000):
        config = pm.peer_config(wheel, 32, 2048, "fp8", "NVIDIA H200", rows)
        nearest = min((int(k) for k in table if k.isdigit()), key=lambda k: abs(k - rows))
        assert config.source == name and config.up == table[str(nearest)] == config.down, rows


@pytest.mark.parametrize("engine_name", ["vllm", "sglang"])
@pytest.mark.parametrize("capability, block_m, block_n, swap", [
    ((9, 0), 16, 128, True), ((9, 0), 32, 64, True), ((9, 0), 64, 128, False), ((9, 0), 16, 32, False),
    ((10, 0), 16, 128, False), ((8, 9), 16, 128, False)])
def test_swap_ab_rule_from_the_engines_file(monkeypatch, engine_name, capability, block_m, block_n, swap):
    wheel = str(pathlib.Path(_peer_file(engine_name)).resolve())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # SGLang's is_sm90_supported also asks for CUDA >= 12.3
    pm.swap_ab_rule.cache_clear()  # its namespace holds facts read when it was built
    try:
        assert pm.swap_ab_rule(wheel)(block_m, block_n) is swap
    finally:
        pm.swap_ab_rule.cache_clear()


# ------------------------------------------------------------------------------------------------
# the engines' W4A16 (INT4 group-32) kernel
# ------------------------------------------------------------------------------------------------
def test_int4_words_read_as_the_engines_bytes():
    from moe_ref.kernels.experts.w4 import pack_int4, unpack_int4

    q = torch.randint(-8, 8, (3, 16), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    peer_bytes = pm.int4_words_as_peer_bytes(pack_int4(q))
    assert peer_bytes.shape == (3, 8) and peer_bytes.dtype == torch.uint8
    low, high = (peer_bytes & 0xF).to(torch.int8) - 8, (peer_bytes >> 4).to(torch.int8) - 8  # elements 2j, 2j + 1
    assert torch.equal(torch.stack([low, high], dim=-1).flatten(-2), unpack_int4(pack_int4(q)))
    assert pm.w4a16_config_problems(dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1,
                                         num_warps=4, num_stages=3), k=96) == [
        "K=96 is not a multiple of BLOCK_SIZE_K=128 (b is loaded unmasked)"]


@pytest.mark.parametrize("engine_name", ["vllm", "sglang"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_real_peer_w4a16_matches_our_int4_twin(engine_name, dtype):
    """The engine's INT4 W4A16 kernel on our INT4 weights (the words read as its bytes) vs our 4-bit MLP's twin on the
    same stored weights (the interpreter: fp32 and fp16, its bf16 arithmetic is wrong)."""
    from moe_ref.kernels.experts.grouped_mlp_w4 import grouped_mlp_w4_ref
    from moe_ref.kernels.experts.w4 import to_group_planes
    from moe_ref.kernels.experts.w4 import quantize_int4
    from moe_ref.testing import calc_diff

    w4 = pm.load_peer_w4a16(_peer_file(engine_name))
    gen = torch.Generator().manual_seed(3)
    counts, hidden, inter, block_m = [5, 0, 19], 64, 32, 16
    layout = ExpertLayout.from_counts(torch.tensor(counts, device=_DEVICE), alignment=1)
    gate_up, gate_up_scale = quantize_int4((torch.randn(3, 2 * inter, hidden, generator=gen) / hidden**0.5).to(_DEVICE))
    down, down_scale = quantize_int4((torch.randn(3, hidden, inter, generator=gen) / inter**0.5).to(_DEVICE))
    x = torch.randn(layout.num_pool_rows, hidden, generator=gen).to(_DEVICE, dtype)
    routing = pm.peer_routing(layout.row_start_e, layout.num_rows_e, layout.num_pool_rows, block_m, w4.peer.engine)
    config = dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    y = pm.run_peer_w4a16_mlp(w4, x, pm.int4_words_as_peer_bytes(gate_up), gate_up_scale,
                              pm.int4_words_as_peer_bytes(down), down_scale, routing, config, config)
    want = grouped_mlp_w4_ref(x, to_group_planes(gate_up, gate_up_scale, "int4"), to_group_planes(down, down_scale, "int4"),
                              layout.row_start_e, layout.num_rows_e)
    assert calc_diff(y.float(), want.float()) < 1e-4
