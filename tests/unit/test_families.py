"""The family registry (``moe_ref.core.families``): each family is data, looked up by model_type."""
from __future__ import annotations

import pytest

from moe_ref.core.families import FAMILIES, family_for_model_type, family_named, supported_model_types

pytestmark = pytest.mark.unit


def test_each_model_type_belongs_to_one_family_and_names_are_unique():
    model_types = supported_model_types()
    assert len(model_types) == len(set(model_types)), model_types
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        assert family_named(family.name) is family
        for model_type in family.model_types:
            assert family_for_model_type(model_type) is family, model_type
    assert family_for_model_type("llama") is None and family_named("custom") is None


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_layout_names_its_experts_in_its_form(family):
    assert family.layouts and family.layouts[0].name == "hub", family.name
    for layout in family.layouts:
        per_expert = layout.experts == "per_expert"
        assert layout.experts in ("per_expert", "stacked", "stacked_gate_up"), layout
        assert (layout.gate_up is not None) == (layout.experts == "stacked_gate_up"), layout
        for name in (layout.gate, layout.up, layout.down):
            assert name is None or ("{expert}" in name) == per_expert, (family.name, layout.name, name)
        assert (layout.shared_gate is not None) == (family.shared.count != 0), (family.name, layout.name)
        assert (layout.router_bias is not None) == family.router.router_bias
        assert (layout.gate_up_bias is not None) == family.experts.bias
