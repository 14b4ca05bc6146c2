"""moe_ref's Triton adapters of the conformance harness (``moe_ref/triton``, ``moe_ref/triton+invariant``) pass its
checks on tiny cases, in one process: on the GPU where there is one, else under the interpreter. The interpreter's
``tl.dot`` is numpy's BLAS, whose sum order may depend on a row's place in the tile on some CPUs
(docs/batch_invariance.md), so there the invariant adapter's bitwise claims (permute, alone) are compared with the
oracle instead; its build path, its chunk loop and its numerics are what this file checks on a CPU."""
import dataclasses

import pytest
import torch

from moe_ref.conformance import registered
from moe_ref.conformance.runner import run_case
from moe_ref.conformance.scenarios import case_by_id

pytestmark = pytest.mark.interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["moe_ref/triton", "moe_ref/triton+invariant"])
@pytest.mark.parametrize("case_id", ["tiny128/bf16/T40", "tiny128/bf16-fp8_block/base", "tiny/bf16/cap+1"])
def test_the_triton_adapters_pass_the_checks_of_a_case(name, case_id):
    impl = registered()[name]
    if DEVICE.type == "cpu":
        impl = dataclasses.replace(impl, caps=dataclasses.replace(impl.caps, batch_invariant=False))
    verdict = run_case(impl, case_by_id(case_id), 0, 1, None, DEVICE)
    assert verdict.status() == "PASS", (verdict.failed, verdict.error)
