#!/usr/bin/env python
"""The Triton fused-MoE kernels that SGLang and vLLM ship, read out of their published wheels at run time: peer
anchors for our grouped expert MLP (`moe_ref.kernels.experts.grouped_mlp`).

    python3 scripts/peer_moe.py --check [--wheel FILE ...]        # PASS/FAIL per case (default: every peer file)
    python3 scripts/peer_moe.py --extract WHEEL --out-dir .whl    # the members this reader opens, as a small zip
    make peers            # .whl/sglang-0.5.23-*.whl and .whl/vllm-0.33.0-fused-moe.zip (the vLLM wheel is not kept)

The reader, the engines' launch rules, the tuners' spaces and the --check cases are `moe_ref.bench.peers` (its
docstring says what runs and how it is checked). Exit status 1 when a --check case fails.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ref.bench.peers import ZIP_SUFFIX, check, default_peer_files, extract_members  # noqa: E402
from moe_ref.bench.peers.loading import REPO  # noqa: E402
from moe_ref.core.errors import MoERefError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare run_peer_mlp with grouped_mlp_ref")
    parser.add_argument("--wheel", action="append", default=None,
                        help="peer file (an engine's wheel or its fused-moe zip), repeatable (default: every peer "
                             "file in .whl/, one per engine)")
    parser.add_argument("--extract", metavar="WHEEL", default=None,
                        help=f"write <engine>-<version>{ZIP_SUFFIX} with the members of WHEEL this reader opens")
    parser.add_argument("--out-dir", default=os.path.join(REPO, ".whl"), help="where --extract writes (.whl/)")
    args = parser.parse_args(argv)
    if args.extract:
        print(extract_members(args.extract, args.out_dir))
        return 0
    if not args.check:
        parser.print_help()
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    wheels = args.wheel or default_peer_files()
    if not wheels:
        print("no peer file: pass --wheel or run `make peers` (.whl/sglang-*.whl, .whl/vllm-*-fused-moe.zip)",
              file=sys.stderr)
        return 2
    try:
        return 1 if check(wheels) else 0
    except MoERefError as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
