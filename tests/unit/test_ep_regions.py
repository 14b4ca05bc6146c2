"""EPRegions: the EP kernels' buffer contract (offsets, alignment, sizes, views) and PeerBuffers."""

import pytest
import torch

from moe_ref.kernels.ep.ep_regions import (
    SIGNAL_REGIONS,
    EPRegions,
    PeerBuffers,
    check_peers,
    default_pool_rows,
    region_names,
    zero_signal_regions,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fp8", [False, True])
def test_regions_are_aligned_disjoint_and_sized(fp8):
    regions = EPRegions.build(2, 192, 8, 128, 7168, activation_dtype=torch.bfloat16, fp8=fp8, base_offset=256)
    spans = sorted((regions.offsets[n], regions.offsets[n] + regions.nbytes(n), n) for n in region_names(fp8))
    assert spans[0][0] == 256
    for (start, end, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        assert start % 128 == 0 and end <= next_start, f"{name} overlaps {next_name}"
    assert regions.end == -(-spans[-1][1] // 128) * 128
    assert regions.spec("recv_x") == ((regions.num_pool_rows, 7168), torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert regions.spec("combine_partial") == ((2, 128, 7168), torch.bfloat16)
    assert ("x_scale" in regions.offsets) == fp8 and ("recv_x_scale" in regions.offsets) == fp8


def test_pool_rows_example_and_views_share_memory():
    assert default_pool_rows(2, 16, 4, 8, 128) == 1152
    regions = EPRegions.build(2, 2, 2, 4, 8, activation_dtype=torch.float32, alignment=4)
    buffer = torch.zeros(regions.end, dtype=torch.uint8)
    regions.view(buffer, "topk_ids")[1, 0] = 7
    start = regions.offsets["topk_ids"] + 2 * 8
    assert buffer[start:start + 8].view(torch.int64).item() == 7
    with pytest.raises(KeyError, match="no region 'x_scale'"):
        regions.view(buffer, "x_scale")


def test_peer_buffers_and_checks():
    regions = EPRegions.build(2, 1, 1, 2, 8, activation_dtype=torch.float32)
    buffers = [torch.full((regions.end,), 5, dtype=torch.uint8) for _ in range(2)]
    peers = PeerBuffers.from_tensors(1, buffers)
    assert peers.ptrs_R.tolist() == [b.data_ptr() for b in buffers] and peers.local is buffers[1]
    check_peers(peers, regions)
    zero_signal_regions(peers, regions)
    assert all((regions.view(buffers[1], n) == 0).all() for n in SIGNAL_REGIONS)
    assert (regions.view(buffers[0], "signal") != 0).all(), "only MY signal regions are zeroed"
    with pytest.raises(ValueError, match="buffer of rank 0"):
        check_peers(PeerBuffers.from_tensors(0, [buffers[0][:-1], buffers[1]]), regions)
    with pytest.raises(ValueError, match="3 in the region layout"):
        check_peers(peers, EPRegions.build(3, 1, 1, 2, 8, activation_dtype=torch.float32))
