"""replica_route (Triton) vs replica_route_ref (torch), bitwise, at the edge cases of the mapping (token blocks, key
columns, x and id dtypes, masked and invalid ids, replica counts), and ``ExpertSlots.to_physical`` on the CPU against
``replica_index`` computed directly."""

import pytest
import torch

from moe_ref.eplb import Placement
from moe_ref.eplb.placement import replica_index
from moe_ref.eplb.slots import ExpertSlots
from moe_ref.kernels.router.replica_route import replica_route, replica_route_ref, token_key

pytestmark = pytest.mark.interpreter

# 8 experts in 14 slots over 2 ranks: experts 0, 3, 4, 7 have 1 replica, 1 and 6 have 2, 2 and 5 have 3
PLACEMENT = Placement(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 2, 5, 5, 6]]), 8, 2)
E, PH = 8, 14
MULTI_REPLICA = {1: [1, 8], 2: [2, 9, 10], 5: [5, 11, 12], 6: [6, 13]}


def _slots(hidden: int, device) -> ExpertSlots:
    return ExpertSlots(PLACEMENT, 0, hidden, torch.device(device))


def _tables(slots: ExpertSlots) -> tuple:
    return (slots.key_columns, slots.key_multipliers, slots.replica_count_E, slots.logical_to_physical_E_,
            slots.num_experts, slots.num_physical)


def _x(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ids(num_tokens: int, num_topk: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Valid ids with masked (-1), too large (E, E + 3) and negative (-2, -7) ones mixed in."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (num_tokens, num_topk), generator=gen)
    spoil = torch.rand(ids.shape, generator=gen)
    ids[spoil < 0.15] = -1
    ids[(spoil >= 0.15) & (spoil < 0.2)] = E
    ids[(spoil >= 0.2) & (spoil < 0.25)] = E + 3
    ids[(spoil >= 0.25) & (spoil < 0.28)] = -2
    ids[(spoil >= 0.28) & (spoil < 0.3)] = -7
    return ids.to(dtype)


def _route_both(x_TD, ids_TK, slots):
    """(kernel, twin) results, checked equal bitwise, int64 [T, K]."""
    got, twin = replica_route(x_TD, ids_TK, *_tables(slots)), replica_route_ref(x_TD, ids_TK, *_tables(slots))
    assert got.dtype == twin.dtype == torch.int64 and got.shape == twin.shape == ids_TK.shape
    assert torch.equal(got, twin)
    return got


@pytest.mark.parametrize("num_tokens,num_topk,hidden,x_dtype,ids_dtype", [
    (0, 8, 64, torch.bfloat16, torch.int64),
    (1, 8, 64, torch.bfloat16, torch.int32),
    (1, 1, 5, torch.float32, torch.int64),
    (129, 8, 200, torch.bfloat16, torch.int64),  # 5 programs, the last one token
    (129, 1, 64, torch.float16, torch.int32),
    (129, 8, 5, torch.float32, torch.int32),  # D < NUM_KEY_COLUMNS: every column is a key column
    (40, 6, 5, torch.float16, torch.int64),
])
def test_kernel_equals_twin_with_masked_and_invalid_ids(num_tokens, num_topk, hidden, x_dtype, ids_dtype, device):
    slots = _slots(hidden, device)
    x, ids = _x(num_tokens, hidden, x_dtype).to(device), _ids(num_tokens, num_topk, ids_dtype).to(device)
    physical = _route_both(x, ids, slots).cpu()
    ids = ids.cpu().to(torch.int64)
    assert torch.equal(physical[ids == -1], ids[ids == -1])
    assert torch.equal(physical[ids < -1], ids[ids < -1])
    assert (physical[ids >= E] == PH).all()
    valid = (ids >= 0) & (ids < E)
    assert torch.equal(PLACEMENT.physical_to_logical_LyPh[0][physical[valid]], ids[valid])


def test_every_replica_serves_and_identical_rows_share_one():
    slots = _slots(64, "cpu")
    ids = torch.tensor([[1, 2, 5, 6, 0, 3, -1, 7]]).expand(129, -1)
    physical = _route_both(_x(129, 64, torch.bfloat16, seed=3), ids, slots)
    for k, expert in enumerate(ids[0].tolist()):
        if expert in MULTI_REPLICA:
            assert sorted(set(physical[:, k].tolist())) == MULTI_REPLICA[expert], (k, expert)
    same = _route_both(_x(1, 64, torch.bfloat16, seed=3).expand(129, -1), ids, slots)  # 129 identical rows
    assert torch.equal(same, same[:1].expand(129, -1))


def test_only_the_sampled_columns_make_the_key():
    slots = _slots(64, "cpu")
    sampled, other = slots.key_columns[5].item(), 2  # column 2 is no key column at D = 64
    assert other not in slots.key_columns.tolist()
    x = _x(1, 64, torch.float16, seed=4).expand(129, -1).clone()
    x[1:, sampled] += torch.arange(1, 129, dtype=torch.float16) / 64  # rows differ in one sampled column
    keys = token_key(x, slots.key_columns, slots.key_multipliers)
    assert keys.unique().numel() == 129
    ids = torch.tensor([[2, 5, 1, 6]]).expand(129, -1)
    physical = _route_both(x, ids, slots)
    assert all(physical[:, k].unique().numel() > 1 for k in range(4))
    x[:, other] = torch.arange(129, dtype=torch.float16)  # a column outside the key changes no slot
    assert torch.equal(token_key(x, slots.key_columns, slots.key_multipliers), keys)
    assert torch.equal(_route_both(x, ids, slots), physical)


@pytest.mark.parametrize("x_dtype,bits_dtype,patterns", [
    (torch.bfloat16, torch.int16, (-1, 0x7FFF, -0x8000)),
    (torch.float32, torch.int32, (-1, 0x7FFFFFFF, -0x80000000)),
])
def test_extreme_bit_patterns(x_dtype, bits_dtype, patterns):
    """All-ones and sign-bit patterns (NaN and -0.0 among them): the largest products and sums of the key."""
    slots = _slots(64, "cpu")
    bits = torch.tensor(patterns, dtype=bits_dtype).repeat_interleave(11)[:, None].expand(-1, 64).contiguous()
    _route_both(bits.view(x_dtype), _ids(bits.shape[0], 8, torch.int64, seed=7), slots)


def test_strided_views():
    slots = _slots(64, "cpu")
    wide_x = _x(70, 128, torch.bfloat16, seed=5)
    wide_ids = _ids(70, 16, torch.int32, seed=5)
    x, ids = wide_x[:, ::2], wide_ids[:, 8:]
    assert not x.is_contiguous() and not ids.is_contiguous()
    assert torch.equal(_route_both(x, ids, slots), replica_route_ref(x.contiguous(), ids.contiguous(), *_tables(slots)))


def test_to_physical_on_the_cpu_is_replica_index_of_the_token_key():
    slots = _slots(96, "cpu")
    x, ids = _x(50, 96, torch.bfloat16, seed=6), _ids(50, 8, torch.int64, seed=6)
    physical = slots.to_physical(x, ids)
    valid = (ids >= 0) & (ids < E)
    expert = ids.clamp(0, E - 1)
    key_T1 = token_key(x, slots.key_columns, slots.key_multipliers).unsqueeze(1)
    replica = replica_index(key_T1, torch.arange(8).unsqueeze(0), PLACEMENT.replica_count_LyE[0][expert])
    expected = PLACEMENT.logical_to_physical_LE_[0][expert, replica]
    assert torch.equal(physical[valid], expected[valid])
    assert torch.equal(physical[~valid], torch.where(ids < 0, ids, PH)[~valid])
