"""router_logits (Triton: bf16/fp16 operands, fp32 sums) vs router_logits_ref (torch: the fp32 GEMM of the upcast
operands): exact on values whose sums are exact in fp32, within the order of fp32 additions otherwise; the other
dtypes and layouts go to the twin itself."""
import pytest
import torch

from moe_ref.kernels.router_logits import router_logits, router_logits_ref

pytestmark = pytest.mark.interpreter

# (T, E, D): empty, one token, D not a whole number of K steps, T and E not whole tiles, a real router's E
SHAPES = [(0, 16, 64), (1, 6, 64), (5, 16, 96), (17, 40, 256), (33, 384, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,hidden", SHAPES)
def test_sums_that_fp32_holds_exactly_come_out_exact(num_tokens, num_experts, hidden, dtype, device):
    """Small integers: every product and partial sum is exact in fp32, so any order of addition gives the twin's
    bits; a kernel that rounded a product or a partial sum to bf16, or dropped or repeated a K step, would not."""
    gen = torch.Generator().manual_seed(num_tokens * 1000 + hidden)
    x = torch.randint(-8, 9, (num_tokens, hidden), generator=gen).to(dtype).to(device)
    w = torch.randint(-8, 9, (num_experts, hidden), generator=gen).to(dtype).to(device)
    got = router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, num_experts) and got.is_contiguous()
    assert torch.equal(got.cpu(), router_logits_ref(x, w).cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_values_within_the_order_of_the_fp32_sums(dtype, device):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_experts, hidden = 19, 48, 320
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    w = (torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5).to(dtype).to(device)
    got, want = router_logits(x, w).cpu(), router_logits_ref(x, w).cpu()
    # each of the D additions rounds by at most half an fp32 ulp of the running sum: bound by D * eps * sum|x w|
    bound = hidden * torch.finfo(torch.float32).eps * (x.float().abs() @ w.float().abs().t()).cpu()
    assert ((got - want).abs() <= bound).all()
    assert torch.equal(router_logits(x, w).cpu(), got)  # one program sums each logit in a fixed order


def test_a_row_slice_of_wider_rows_reads_its_own_columns(device):
    """x with a row stride wider than D (a view of wider rows) and the kernel's strides."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randint(-4, 5, (7, 96), generator=gen).to(torch.bfloat16).to(device)
    w = torch.randint(-4, 5, (20, 64), generator=gen).to(torch.bfloat16).to(device)
    x = wide[:, 16:80]
    assert x.stride() == (96, 1)
    assert torch.equal(router_logits(x, w).cpu(), router_logits_ref(x, w).cpu())


@pytest.mark.parametrize("case", ["fp32", "mixed", "strided_columns"])
def test_other_operands_are_the_twins_own_fp32_gemm(case, device):
    """fp32 operands, mixed dtypes and a non-unit column stride are the twin's: bitwise its result."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=gen).to(device)
    w = torch.randn(10, 64, generator=gen).to(device)
    if case == "mixed":
        x = x.bfloat16()
    elif case == "strided_columns":
        x, w = torch.randn(6, 128, generator=gen).bfloat16().to(device)[:, ::2], w.bfloat16()
    assert torch.equal(router_logits(x, w).cpu(), router_logits_ref(x, w).cpu())


def test_shapes_that_do_not_match_are_a_shape_error(device):
    from moe_ref.core.errors import ShapeError

    with pytest.raises(ShapeError, match="router_logits takes x"):
        router_logits(torch.zeros(3, 64, dtype=torch.bfloat16, device=device),
                      torch.zeros(4, 32, dtype=torch.bfloat16, device=device))
