"""scripts/probe_tile_bits.py without a GPU: the groups of bits are printed one way for every probe."""
from __future__ import annotations

import pytest

from script_loader import load_script

pytestmark = pytest.mark.unit
probe = load_script("probe_tile_bits")


def test_groups_print_their_count_then_each_digest_with_its_members(capsys):
    groups = {"aaa": [[16, 64], [32, 64]], "bbb": [[128, 128]]}
    probe.print_groups("w4 int4 gemm1", "tiles", groups)
    probe.print_groups("deep_gemm fp8", "pools", {"ccc": [{"n": 1}, {"n": 8}]}, lambda ms: [m["n"] for m in ms])
    assert capsys.readouterr().out.splitlines() == [
        "w4 int4 gemm1: 2 group(s) of bits over 3 tiles", "  aaa: [[16, 64], [32, 64]]", "  bbb: [[128, 128]]",
        "deep_gemm fp8: 1 group(s) of bits over 2 pools", "  ccc: [1, 8]"]
