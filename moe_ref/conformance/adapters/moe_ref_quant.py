"""moe_ref's experts kept quantized as stored (``moe_ref.experts.quantized``), under test from outside, through the
published checkpoint layout: the harness's codes and scales are packed by ``scenarios.published_form`` (the
layouts of ``moe_ref.checkpoint.formats``), written as a one-layer safetensors checkpoint under the published
names (DeepSeek-V3's, which Kimi-K2 and the custom family share), and read back by moe_ref's own loader
(``load_quantized_experts``: its dtype, shape and MXFP4 scale-byte checks), so a case also checks that the loader
takes what the formats' documentation says a checkpoint holds.

| name                   | experts (``moe_ref.experts.quantized``)                               | devices |
|------------------------|-----------------------------------------------------------------------|---------|
| ``moe_ref/quant/torch``  | ``QuantTorchExperts``: each expert dequantized to fp32 when it runs    | cpu     |
| ``moe_ref/quant/triton`` | ``W4A16Experts`` (int4, mxfp4), ``FP8BlockExperts`` (fp8_block), the | cuda    |
|                        | weights rewritten for the kernel as the layer holds them (``held``)   |         |
| ``moe_ref/quant/triton+invariant`` | ``FP8BlockExperts`` in the batch-invariant mode (fp8_block) | cuda    |

Both run in moe_ref's modular routed step (transport, overflow ``error``, chunk loop); fp8_block dispatches FP8 rows
(``dispatch_fp8``: e4m3 with one scale per token per 128 columns, what the oracle quantizes).

Shape legend: e local experts, D hidden width, F expert intermediate, O output and I input features of one weight.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from moe_ref.conformance.adapters.moe_ref_impls import CAP, _config, _options, step_runner
from moe_ref.conformance.api import Capabilities, Implementation, Problem, register
from moe_ref.conformance.scenarios import published_form

LAYER_PREFIX = "model.layers."
FORMATS = {"fp8_block": "fp8_block", "int4": "int4_group", "mxfp4": "mxfp4"}  # the recipe -> moe_ref's QuantFormat


def checkpoint_tensors(problem: Problem) -> dict[str, torch.Tensor]:
    """This rank's experts under their published names (global expert ids), each weight ``[O, I]`` packed as
    published (``published_form``), on the CPU."""
    from moe_ref.checkpoint.formats import QuantSpec
    from moe_ref.checkpoint.names import layer_names

    w = problem.weights
    spec = QuantSpec.published(FORMATS[w.quant])
    names = layer_names("custom", "hub", f"{LAYER_PREFIX}0.")
    gate_up_q, gate_up_s = (t.cpu() for t in published_form(w.gate_up_q, w.gate_up_scale, w.quant))
    down_q, down_s = (t.cpu() for t in published_form(w.down_q, w.down_scale, w.quant))
    half_q, half_s = gate_up_q.shape[1] // 2, gate_up_s.shape[1] // 2  # fp8: F/128 scale rows per half (F % 128 == 0)
    tensors = {}
    for i in range(problem.num_local_experts):
        expert = problem.first_expert + i
        for template, q, s, (out_f, in_f) in (
                (names.gate, gate_up_q[i, :half_q], gate_up_s[i, :half_s], (problem.intermediate, problem.hidden)),
                (names.up, gate_up_q[i, half_q:], gate_up_s[i, half_s:], (problem.intermediate, problem.hidden)),
                (names.down, down_q[i], down_s[i], (problem.hidden, problem.intermediate))):
            stem = template.format(expert=expert)[:-len(".weight")]
            tensors[f"{stem}.{spec.weight_suffix}"] = q.contiguous()
            tensors[f"{stem}.{spec.scale_suffix}"] = s.contiguous()
            if w.quant == "int4":
                tensors[f"{stem}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int32)
    return tensors


def load_as_published(problem: Problem):
    """This rank's experts written as a published checkpoint and read back by ``load_quantized_experts`` onto the
    problem's device: a ``QuantizedExpertWeights`` in the checkpoint's order."""
    from safetensors.torch import save_file

    from moe_ref.checkpoint.formats import QuantSpec
    from moe_ref.checkpoint.quantized import load_quantized_experts

    with tempfile.TemporaryDirectory(prefix="moe_ref_conform_ckpt_") as folder:
        path = Path(folder) / "model.safetensors"
        save_file(checkpoint_tensors(problem), str(path))
        return load_quantized_experts(path, _config(problem), 0, (problem.first_expert, problem.num_local_experts),
                                      problem.device, spec=QuantSpec.published(FORMATS[problem.weights.quant]),
                                      prefix=LAYER_PREFIX, progress=False)


def quant_step_factory(backend: str, transport: str = "auto", batch_invariant: bool = False):
    """``Problem -> run``: moe_ref's modular routed step over ``make_quantized_experts(..., backend=backend)`` (in the
    batch-invariant mode with ``batch_invariant``, as the layer builds it there)."""
    def factory(problem: Problem):
        from moe_ref.experts.quantized import (QuantTorchExperts, W4A16Experts, make_quantized_experts,
                                               quantized_experts_class)

        qweights = load_as_published(problem)
        runs_on = quantized_experts_class(qweights.spec.format, backend, problem.device)
        if runs_on is W4A16Experts:  # rewritten for the kernel, as the layer holds them (moe_ref.layer.weights.held)
            qweights = qweights.with_group_planes()
        elif runs_on is not QuantTorchExperts:
            qweights = qweights.with_interleaved_gate_up()
        experts = make_quantized_experts(qweights, backend=backend)
        experts.batch_invariant = batch_invariant
        return step_runner(problem, experts, _options(problem, backend, transport, "error",
                                                      dispatch_fp8=problem.weights.quant == "fp8_block",
                                                      alignment=experts.segment_alignment,
                                                      batch_invariant=batch_invariant))

    return factory


_QUANT = dict(quants=("int4", "mxfp4", "fp8_block"), ep_sizes=(1, 2, 4), max_tokens_per_rank=CAP, overflow="error",
              configurable_cap=True, deterministic=True, duplicate_experts=False, masked_slots=True)
# the torch loop computes whole 128-row segments of fp32 GEMMs over each expert's dequantized weights
register(Implementation("moe_ref/quant/torch", "routed_step",
                        Capabilities(dtypes=("fp32", "bf16"), **_QUANT, batch_invariant=True, devices=("cpu",),
                                     tile_rows=128),
                        quant_step_factory("torch"), "quantized experts as stored: the torch loop",
                        spec="moe_ref/quant/torch"))
register(Implementation("moe_ref/quant/triton", "routed_step",
                        Capabilities(dtypes=("bf16",), **_QUANT, devices=("cuda",), tile_rows=64, graph_safe=True),
                        quant_step_factory("triton"), "quantized experts as stored: W4A16 / FP8 block kernels",
                        spec="moe_ref/quant/triton"))
# FP8-block experts on the grouped MLP's tiles of one bits class, INT4 and MXFP4 on the W4A16 kernel's one tile pair
register(Implementation("moe_ref/quant/triton+invariant", "routed_step",
                        Capabilities(dtypes=("bf16",), **_QUANT, batch_invariant=True, devices=("cuda",), tile_rows=64,
                                     graph_safe=True),
                        quant_step_factory("triton", batch_invariant=True),
                        "quantized experts as stored, the batch-invariant mode", spec="moe_ref/quant/triton+invariant"))
