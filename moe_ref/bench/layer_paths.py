"""The routed-step paths scripts/bench_layer.py times and scripts/profile_step.py profiles, at Kimi-K2 shapes
(`DEFAULT_SHAPE`): this rank's experts (`make_weights`), its routed inputs (`make_inputs`), and per path a builder
(`BUILDERS`) returning ``(fn, cleanup)``: the NCCL all-to-all + torch grouped_mm anchor, the public modular step
(`make_modular_step`) with each experts backend and pool format, DeepGEMM's mega-MoE, identity experts (dispatch and
combine alone), and each moe_ref path captured once in a CUDA graph (``*_graph``). Every path runs one code path for
torchrun ranks and one plain process (`moe_ref.bench.ranks`).

Shape legend: T tokens of this rank, K top-k, N routed entries, e local experts, D hidden width, F expert
intermediate (2F: gate rows then up rows), P receive-pool rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_ref.bench.cases import grouped_mm_fn
from moe_ref.bench.ranks import all_to_all_single, rank
from moe_ref.ep.distributed import group_size_and_rank
from moe_ref.experts import Experts
from moe_ref.testing import graphed

# the benchmark's shape and seed (bench_layer's command-line defaults): 384 experts over all ranks, top-8
DEFAULT_SHAPE = {"num_experts": 384, "num_topk": 8, "hidden": 7168, "intermediate": 2048, "seed": 0}
DEFAULT_PATHS = ("a2a_grouped_mm", "moe_ref_triton", "moe_ref_triton_graph", "moe_ref_triton_fp8",
                 "moe_ref_triton_fp8_graph", "deep_gemm_mega", "a2a_identity", "moe_ref_identity",
                 "moe_ref_identity_graph")
# paths that cannot run in one process: (ranks they need, why)
MIN_RANKS = {"deep_gemm_mega": (2, "DeepGEMM's SM90 mega-MoE needs 2+ ranks sharing symmetric memory (in one process "
                                   "moe_ref_deep_gemm_fp8 runs DeepGEMM's grouped GEMMs)")}


def make_weights(args, rank: int, num_local: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's bf16 experts: gate_up [e, 2F, D], down [e, D, F] (scaled so outputs stay O(1))."""
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    D, Fi = args.hidden, args.intermediate
    gate_up = torch.empty(num_local, 2 * Fi, D, dtype=torch.bfloat16, device=device)
    down = torch.empty(num_local, D, Fi, dtype=torch.bfloat16, device=device)
    for i in range(num_local):  # one expert at a time: no fp32 copy of all weights
        gate_up[i] = torch.randn(2 * Fi, D, device=device, generator=gen) * D ** -0.5
        down[i] = torch.randn(D, Fi, device=device, generator=gen) * Fi ** -0.5
    return gate_up, down


def make_inputs(args, rank: int, num_tokens: int, device):
    """x [T, D] bf16, topk ids [T, K] int64 (distinct, uniform), topk weights [T, K] fp32."""
    gen = torch.Generator(device=device).manual_seed(args.seed * 7919 + 31 * rank + num_tokens)
    x = torch.randn(num_tokens, args.hidden, device=device, generator=gen).bfloat16()
    scores = torch.rand(num_tokens, args.num_experts, device=device, generator=gen)
    weights, ids = scores.topk(args.num_topk, dim=-1)
    return x, ids.to(torch.int64), (weights / weights.sum(-1, keepdim=True)).float()


# ------------------------------------------------------------------------------------------------
# paths: each builder returns (fn, cleanup)
# ------------------------------------------------------------------------------------------------
def build_a2a_grouped_mm(args, cfg, group, num_tokens, local_weights, device, *, identity: bool = False):
    """The NCCL anchor: all_to_all_single of counts, rows and local expert ids, a sort by expert, torch grouped_mm
    (gate||up), SiLU-and-mul in fp32, grouped_mm (down), all_to_all_single back and an fp32 weighted index_add at the
    source; ``identity``: the expert GEMMs left out (dispatch and combine alone). The step takes x ``[T, D]`` bf16,
    topk ids ``[T, K]`` int64 and weights ``[T, K]`` fp32 and syncs the host once (the split sizes)."""
    grouped_mm = grouped_mm_fn()
    if grouped_mm is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm")
    gate_up, down = local_weights
    gate_up_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    world, num_local, Fi, K = group_size_and_rank(group)[0], gate_up.shape[0], args.intermediate, args.num_topk

    def step(x_TD, ids_TK, weights_TK):
        num_tokens_, dim = x_TD.shape
        flat_ids = ids_TK.reshape(-1)
        slot_N = (flat_ids >= 0).nonzero().squeeze(1)
        expert_N = flat_ids[slot_N]
        order = torch.argsort(expert_N, stable=True)
        slot_N, expert_N = slot_N[order], expert_N[order]
        dst_N = expert_N // num_local
        send_counts = torch.bincount(dst_N, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # NOTE: host sync
        num_recv = sum(recv_splits)
        recv_x = x_TD.new_empty(num_recv, dim)
        all_to_all_single(recv_x, x_TD[slot_N // K], recv_splits, send_splits, group=group)
        recv_expert = torch.empty(num_recv, dtype=torch.int64, device=x_TD.device)
        all_to_all_single(recv_expert, expert_N - dst_N * num_local, recv_splits, send_splits, group=group)
        perm = torch.argsort(recv_expert, stable=True)
        offs = torch.bincount(recv_expert, minlength=num_local).cumsum(0).to(torch.int32)
        y_recv = recv_x if identity else x_TD.new_empty(num_recv, dim)
        if num_recv and not identity:
            gate_up_rows = grouped_mm(recv_x[perm], gate_up_t, offs=offs)
            h = (F.silu(gate_up_rows[:, :Fi].float()) * gate_up_rows[:, Fi:].float()).bfloat16()
            y_recv[perm] = grouped_mm(h, down_t, offs=offs)
        back = x_TD.new_empty(slot_N.shape[0], dim)
        all_to_all_single(back, y_recv, send_splits, recv_splits, group=group)
        out = torch.zeros(num_tokens_, dim, dtype=torch.float32, device=x_TD.device)
        out.index_add_(0, slot_N // K, back.float() * weights_TK.reshape(-1)[slot_N, None])
        return out.to(x_TD.dtype)

    return step, lambda: None


def build_a2a_identity(args, cfg, group, num_tokens, local_weights, device):
    return build_a2a_grouped_mm(args, cfg, group, num_tokens, local_weights, device, identity=True)


def build_moe_ref(args, cfg, group, num_tokens, local_weights, device, *, backend: str = "triton", fp8: bool = False,
                  pool_format: str = "contiguous", identity: bool = False):
    """The public modular step: ``backend`` experts (with ``fp8``: fp8 weights, and FP8 dispatch, whose pool they take
    as is) over a ``pool_format`` pool."""
    from moe_ref.experts import make_experts
    from moe_ref.ep.options import EPOptions
    from moe_ref.ep.routed_step import make_modular_step

    experts = IdentityExperts(*local_weights) if identity else make_experts(backend, *local_weights, cfg.activation,
                                                                            fp8=fp8)
    options = EPOptions.resolve(num_max_tokens_per_rank=num_tokens, overflow="error", dtype=torch.bfloat16,
                                device=device, dispatch_fp8=fp8, experts_backend=backend,
                                pool_format=pool_format)
    step = make_modular_step(cfg, group, experts, options)
    print(f"[rank {rank()}] moe_ref routed step: transport={step.transport_name}, experts={experts.name}, "
          f"fp8={fp8}, alignment={step.plan.alignment}, pool {pool_format} {step.plan.num_pool_rows} rows, "
          f"buffer {step.plan.total_bytes} bytes", flush=True)
    return step, step.destroy


def modular(**kwargs):
    """A builder of ``build_moe_ref`` with these options."""
    return lambda *args: build_moe_ref(*args, **kwargs)


class IdentityExperts(Experts):
    """y = x: the routed step's dispatch + combine alone (bf16 pool rows returned as they are)."""

    name = "identity"
    segment_alignment = 1

    def forward(self, x_PD, layout, x_scale_PDb=None):
        return x_PD


def graphed_step(builder):
    """``builder``'s step captured once in a CUDA graph (``moe_ref.testing.graphed``); each call copies its inputs in
    and replays."""
    def build(args, cfg, group, num_tokens, local_weights, device):
        step, cleanup = builder(args, cfg, group, num_tokens, local_weights, device)
        static = [t.clone() for t in make_inputs(args, rank(), num_tokens, device)]
        return graphed(step, *static), cleanup

    return build


def build_deep_gemm_mega(args, cfg, group, num_tokens, local_weights, device):
    from moe_ref.ep.mega_deep_gemm import make_mega_step
    from moe_ref.ep.options import EPOptions

    options = EPOptions.resolve(num_max_tokens_per_rank=num_tokens, overflow="error", dtype=torch.bfloat16,
                                device=device, experts_backend="deep_gemm")
    mega = make_mega_step(cfg, group, options, *local_weights)
    print(f"[rank {rank()}] DeepGEMM mega-MoE: symmetric buffer {mega.engine.buffer_bytes} bytes", flush=True)
    return mega, mega.destroy


MODULAR = {  # path -> the options of its modular step
    "moe_ref_triton": {}, "moe_ref_triton_fp8": dict(fp8=True),
    "moe_ref_triton_masked": dict(pool_format="masked"), "moe_ref_triton_fp8_masked": dict(fp8=True, pool_format="masked"),
    "moe_ref_deep_gemm_fp8": dict(backend="deep_gemm", fp8=True),
    "moe_ref_deep_gemm_fp8_masked": dict(backend="deep_gemm", fp8=True, pool_format="masked"),
    "moe_ref_identity": dict(identity=True),
}
BUILDERS = {"a2a_grouped_mm": build_a2a_grouped_mm, "deep_gemm_mega": build_deep_gemm_mega,
            "a2a_identity": build_a2a_identity}
for _name, _options in MODULAR.items():
    BUILDERS[_name] = modular(**_options)
    BUILDERS[f"{_name}_graph"] = graphed_step(modular(**_options))
PATHS = tuple(BUILDERS)  # every path --paths can name
