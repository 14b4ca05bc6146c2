"""moe_ref inside transformers models, against transformers' own modules as the oracle (CPU, fp32, tiny random models
of each family built from its config class, seed 0):

- ``patch_model``: every sparse MoE block becomes a MegaMoE over the block's own tensors; logits within 1e-5 of the
  unpatched model, greedy ``generate`` identical, router logits recorded as before, a prefill above the cap chunked,
  dense layers kept, autograd refused (INP007), no second copy of the experts;
- ``experts_implementation="moe_ref"``: a model loaded with it equals the default implementation;
- the refusals: unsupported models (CFG030), transformers' expert parallelism (CFG031), offloaded blocks (LOAD022),
  transformers missing (ENV022).

Parametrized by every MoE family moe_ref reads (``moe_ref.core.families``) that transformers has:
``test_every_family_moe_ref_reads_has_a_tiny_model`` fails until a family the table gains has a tiny model here."""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import hf_tiny_models as tiny
from moe_ref.core.errors import (BlockWeightsUnavailableError, ExpertsInterfaceParallelError,
                                 GradientNotSupportedError, InvalidConfigError, OptionalDependencyError,
                                 UnsupportedModelError)
from moe_ref.integrations.transformers import PatchedMoEBlock, patch_model
from moe_ref.integrations.transformers.library import require_transformers

pytestmark = pytest.mark.unit
RTOL = 1e-5  # fp32: relative to the largest logit


# every family moe_ref reads (test_every_family_moe_ref_reads_has_a_tiny_model keeps the list whole)
FAMILIES = tiny.MODEL_TYPES


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, **case) -> None:
    scale = float(expected.abs().max())
    err = float((actual - expected).abs().max())
    assert actual.shape == expected.shape and err <= RTOL * scale, f"{err=} {scale=} {case}"


def patched_and_reference(model_type: str, **options):
    reference, patched = tiny.tiny_model(model_type), tiny.tiny_model(model_type)
    report = patch_model(patched, **options)
    return reference, patched, report


def test_every_family_moe_ref_reads_has_a_tiny_model():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from moe_ref.core.families import supported_model_types

    known = supported_model_types()
    in_transformers = [t for t in known if t in CONFIG_MAPPING_NAMES]
    assert [t for t in in_transformers if t not in tiny.MODEL_TYPES] == []


@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_model_matches_transformers(model_type):
    reference, patched, report = patched_and_reference(model_type)
    moe_layers = [i for i, layer in enumerate(patched.model.layers) if isinstance(layer.mlp, PatchedMoEBlock)]
    assert [b.layer_idx for b in report.blocks] == moe_layers and moe_layers
    assert list(report.dense_layers) == [i for i in range(2) if i not in moe_layers]
    experts = next(m for m in reference.modules() if hasattr(m, "down_proj") and hasattr(m, "is_transposed"))
    if not (experts.is_transposed or experts.has_bias or not experts.is_concatenated):  # moe_ref's own layout
        assert all(b.shares_expert_storage for b in report.blocks), str(report)
    x = tiny.prompt()
    with torch.no_grad():
        expected, actual = reference(x).logits, patched(x).logits
        # the MoE blocks matter: the same model without its routed experts' output is far off
        first = reference.model.layers[moe_layers[0]].mlp
        with torch.no_grad():
            first.experts.down_proj.mul_(0)
        without_experts = reference(x).logits
    assert float((without_experts - expected).abs().max()) > 100 * RTOL * float(expected.abs().max())
    assert_logits_close(actual, expected, model_type=model_type)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_generate_is_identical(model_type):
    reference, patched, report = patched_and_reference(model_type)
    assert report.blocks
    x = tiny.prompt(batch=1, length=6)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected, actual = reference.generate(x, **kwargs), patched.generate(x, **kwargs)
    assert expected.shape[1] == 6 + 16
    assert torch.equal(actual, expected), f"{model_type=}\n{expected=}\n{actual=}"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_router_logits_are_recorded_as_transformers_records_them(model_type):
    reference, patched, _ = patched_and_reference(model_type)
    x = tiny.prompt()
    with torch.no_grad():
        expected = reference(x, output_router_logits=True)
        actual = patched(x, output_router_logits=True)
        plain = patched(x)  # without the request, the router is not run a second time
    assert expected.router_logits and len(actual.router_logits) == len(expected.router_logits)
    for layer, (got, want) in enumerate(zip(actual.router_logits, expected.router_logits)):
        # later MoE layers see the earlier ones' outputs, equal within fp32 rounding, not bitwise
        assert_logits_close(got, want, model_type=model_type, moe_layer=layer)
    if expected.aux_loss is not None:
        assert torch.allclose(actual.aux_loss, expected.aux_loss, rtol=RTOL), model_type
    assert getattr(plain, "router_logits", None) is None


def test_a_prefill_above_the_cap_is_chunked_by_default(monkeypatch):
    from moe_ref.ep import overflow

    monkeypatch.setattr(overflow, "_ANNOUNCED", set())  # chunking is announced once per process
    reference, patched, _ = patched_and_reference("deepseek_v3", num_max_tokens_per_rank=8)
    x = tiny.prompt(batch=2, length=20)  # 40 rows per call, cap 8: 5 chunks
    with torch.no_grad(), pytest.warns(Warning, match="chunks"):
        actual = patched(x).logits
    with torch.no_grad():
        assert_logits_close(actual, reference(x).logits)
    assert patched.model.layers[1].mlp.moe.options.overflow == "chunk"


def test_the_overflow_policy_is_the_callers_to_choose():
    from moe_ref.core.errors import CapacityExceededError

    _, patched, _ = patched_and_reference("deepseek_v3", num_max_tokens_per_rank=8, overflow="error")
    with torch.no_grad(), pytest.raises(CapacityExceededError, match="CAP001"):
        patched(tiny.prompt(batch=2, length=20))


def test_a_call_with_autograd_on_raises_inp007():
    _, patched, _ = patched_and_reference("deepseek_v3")
    with pytest.raises(GradientNotSupportedError, match="INP007"):
        patched(tiny.prompt())


def test_the_block_is_dropped_and_its_experts_are_not_copied():
    model = tiny.tiny_model("deepseek_v3")
    block = model.model.layers[1].mlp
    gate_up = block.experts.gate_up_proj
    pointers = (gate_up.data_ptr(), block.experts.down_proj.data_ptr(), block.gate.weight.data_ptr())
    block_ref, experts_ref = weakref.ref(block), weakref.ref(block.experts)
    del block, gate_up
    patch_model(model)
    gc.collect()
    assert block_ref() is None and experts_ref() is None
    moe = model.model.layers[1].mlp.moe
    assert (moe.gate_up_weight.data_ptr(), moe.down_weight.data_ptr(), moe.gate_weight.data_ptr()) == pointers
    assert not moe.gate_up_weight.requires_grad


def test_the_report_names_blocks_and_dense_layers(capsys):
    model = tiny.tiny_model("deepseek_v3")
    report = patch_model(model, verbose=True)
    printed = capsys.readouterr().out
    assert "DeepseekV3MoE -> MegaMoE" in printed and "1 dense layers kept [0]" in printed
    assert (report.family, report.ep_size, len(report.blocks)) == ("deepseek_v3", 1, 1)
    assert report.blocks[0].num_local_experts == tiny.EXPERTS


def test_unsupported_models_and_options_are_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(UnsupportedModelError, match="CFG030.*no sparse MoE block"):
        patch_model(dense)
    model = tiny.tiny_model("deepseek_v3")
    with pytest.raises(InvalidConfigError, match="CFG007.*dtype"):
        patch_model(model, dtype=torch.bfloat16)
    patch_model(model)
    with pytest.raises(UnsupportedModelError, match="patched already"):
        patch_model(model)


def test_a_model_type_moe_ref_does_not_read_is_cfg030(monkeypatch):
    model = tiny.tiny_model("deepseek_v3")
    monkeypatch.setattr(type(model.config), "model_type", "my_moe")  # to_dict() writes the class attribute
    with pytest.raises(UnsupportedModelError, match="CFG030.*'my_moe'"):
        patch_model(model)


def test_what_a_block_returns_is_found_before_it_is_replaced():
    """gpt-oss's block returns (hidden, router scores), which its decoder layer unpacks: the patched block must too
    (a tensor would be unpacked along its batch rows, silently); another tuple is refused."""
    from moe_ref.integrations.transformers.blocks import find_moe_blocks
    from moe_ref.integrations.transformers.patch import block_returns, router_of

    for model_type, pair in (("gpt_oss", True), ("deepseek_v3", False), ("mixtral", False)):
        site = find_moe_blocks(tiny.tiny_model(model_type))[0]
        assert block_returns(site, router_of(site), tiny.HIDDEN) is pair, model_type
    site = find_moe_blocks(tiny.tiny_model("mixtral"))[0]
    forward = site.block.forward
    site.block.forward = lambda x: (forward(x), None, None)
    with pytest.raises(UnsupportedModelError, match="CFG030.*returns tuple of 3"):
        block_returns(site, router_of(site), tiny.HIDDEN)


def test_an_offloaded_block_is_load022():
    model = tiny.tiny_model("deepseek_v3")
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = torch.nn.Parameter(torch.empty_like(experts.down_proj, device="meta"))
    with pytest.raises(BlockWeightsUnavailableError, match="LOAD022.*experts.down_proj.*meta"):
        patch_model(model)


# --- experts_implementation="moe_ref" ------------------------------------------------------------------

def _interface_families() -> list[str]:
    """The families whose experts module goes through transformers' ExpertsInterface in moe_ref's layout."""
    out = []
    for t in tiny.MODEL_TYPES:
        experts = next(m for m in tiny.tiny_model(t).modules() if hasattr(m, "gate_up_proj"))
        if getattr(experts, "has_bias", True) is False and getattr(experts, "is_transposed", True) is False:
            out.append(t)
    return out


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    return tiny.saved_once(tmp_path_factory.mktemp("hf_models"))


@pytest.mark.parametrize("model_type", _interface_families())
def test_experts_implementation_moe_ref_equals_the_default(model_type, saved_models):
    from transformers import AutoModelForCausalLM

    path = saved_models(model_type)
    default = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="moe_ref").eval()
    assert ours.config._experts_implementation == "moe_ref"
    x = tiny.prompt()
    with torch.no_grad():
        assert_logits_close(ours(x).logits, default(x).logits, model_type=model_type)
    runners = [m.__dict__.get("_moe_ref_runner") for m in ours.modules() if hasattr(m, "gate_up_proj")]
    assert runners and all(r is not None for r in runners)  # every experts module ran moe_ref's step
    step = runners[0].step
    assert step.experts.gate_up_weight_e2FD.data_ptr() == next(
        m for m in ours.modules() if hasattr(m, "gate_up_proj")).gate_up_proj.data_ptr()  # the module's own weights


def test_experts_implementation_moe_ref_refuses_autograd_and_transformers_ep(saved_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_models("deepseek_v3"), experts_implementation="moe_ref")
    with pytest.raises(GradientNotSupportedError, match="INP007"):
        model(tiny.prompt())
    for module in model.modules():
        if hasattr(module, "gate_up_proj"):
            module._is_expert_parallel = True
    with torch.no_grad(), pytest.raises(ExpertsInterfaceParallelError, match="CFG031.*patch_model"):
        model(tiny.prompt())


def test_experts_implementation_moe_ref_refuses_a_layout_it_does_not_run(saved_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_models("gpt_oss"), experts_implementation="moe_ref")
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="CFG030.*has_bias=True"):
        model(tiny.prompt())


# --- transformers stays optional (that `import moe_ref` imports neither: tests/dist/test_patch_dist.py) ----------

def test_transformers_missing_is_env022(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(OptionalDependencyError, match="ENV022.*pip install"):
        require_transformers()
