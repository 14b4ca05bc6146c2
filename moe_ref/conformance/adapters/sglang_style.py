"""The worked example of docs/conform.md: a fused-MoE kernel with SGLang's ``fused_experts`` signature plugged in.

``fused_experts`` below is a plain torch stand-in with that signature (so the example runs anywhere); on a GPU with
SGLang installed, replace it with ``from sglang.srt.layers.moe.fused_moe_triton import fused_experts``.

Shape legend: T tokens of this rank, K top-k, E experts, D hidden width, F expert intermediate.
"""
import torch

from moe_ref.conformance.api import Capabilities, Problem, implementation


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False, activation="silu"):
    """``[T, D]``, w1 ``[E, 2F, D]``, w2 ``[E, D, F]``, ``[T, K]`` weights and ids -> ``[T, D]`` (ids -1 skipped)."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for expert in topk_ids.unique().tolist():
        if expert < 0:
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = (hidden_states[token].float() @ w1[expert].float().T).chunk(2, dim=-1)
        out.index_add_(0, token, topk_weights[token, slot, None] * ((gate * torch.sigmoid(gate) * up) @ w2[expert].float().T))
    return out.to(hidden_states.dtype)


@implementation("example:sglang-style", kind="experts",
                caps=Capabilities(dtypes=("fp32", "bf16"), deterministic=True, masked_slots=True))
def sglang_style(problem: Problem):
    w1, w2 = problem.weights.gate_up_e2FD, problem.weights.down_eDF  # SGLang's layout: [E, 2F, D], [E, D, F]

    def run(x_TD, topk_ids_TK, topk_weights_TK, out_TD):
        out_TD.copy_(fused_experts(x_TD, w1, w2, topk_weights_TK, topk_ids_TK))

    return run
