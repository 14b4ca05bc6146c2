"""The engines' tile configs for one launch (`peer_config`): the tuned file of the wheel for (E, N = F, device,
dtype), the entry whose batch key is nearest to the routed rows; else the engine's default rule run from its source.
SGLang searches its `configs/triton_<version>/` folders (the running Triton's first) and may have `_down` files for
GEMM2; vLLM has one `configs/` folder and one config for both GEMMs (see `moe_ref.bench.peers`).
"""
from __future__ import annotations

import dataclasses
import json
import re

from moe_ref.bench.peers.engines import engine_of, read_member
from moe_ref.bench.peers.source import wheel_files


@dataclasses.dataclass
class PeerConfig:
    """The engine's tile configs for one launch: GEMM1 (`up`) and GEMM2 (`down`), and where they came from."""

    up: dict
    down: dict
    source: str      # the config file in the wheel, or "default rule (get_default_config)"
    num_rows: int    # M used for the lookup

    @property
    def block_m(self) -> int:
        return self.up["BLOCK_SIZE_M"]


def find_config_file(wheel: str, name: str, triton_version: str) -> str | None:
    """The wheel path of config file `name`, searched as the engine's `get_moe_configs` searches
    (`PeerEngine.config_folders`); None when no folder has it."""
    files = set(wheel_files(wheel))
    for folder in engine_of(wheel)[0].config_folders(wheel, triton_version):
        if f"{folder}/{name}" in files:
            return f"{folder}/{name}"
    return None


def tuned_shapes(wheel: str, device_name: str, dtype: str) -> list[tuple[int, int, str]]:
    """(E, N, folder) of every tuned GEMM1 file the wheel has for this device and dtype, sorted.

    Example: an H200 block-FP8 lookup in the SGLang 0.5.23 wheel lists (72, 2048, 'triton_3_8_0') among others;
    in the vLLM 0.33.0 wheel (32, 2048, 'configs')."""
    engine = engine_of(wheel)[0]
    rest = engine.config_file_name(0, 0, device_name, dtype).split(",", 2)[2]
    found = set()
    for folder in engine.config_folders(wheel, "0"):
        for path in wheel_files(wheel):
            name = path.removeprefix(folder + "/")
            match = re.fullmatch(r"E=(\d+),N=(\d+),(.*)", name)
            if name != path and "/" not in name and match and match.group(3) == rest:
                found.add((int(match.group(1)), int(match.group(2)), folder.rsplit("/", 1)[-1]))
    return sorted(found)


def nearest_tuned(wheel: str, num_experts: int, inter: int, device_name: str, dtype: str) -> str:
    """A note naming the tuned files nearest to (E, N) for this device and dtype (same N first), for reports."""
    shapes = tuned_shapes(wheel, device_name, dtype)
    if not shapes:
        return f"the wheel has no tuned {device_name} {dtype} file at all"
    best = min(shapes, key=lambda s: (s[1] != inter, abs(s[1] - inter), abs(s[0] - num_experts)))
    same = [s for s in shapes if s[1] == best[1]]
    return (f"no tuned file for E={num_experts},N={inter} on {device_name} ({dtype}); nearest: "
            + ", ".join(f"E={e},N={n} ({folder})" for e, n, folder in same))


def _nearest(configs: dict, num_rows: int) -> dict:
    """The entry whose batch-size key is nearest to `num_rows` (ties: the first in file order, as `min` picks);
    other keys (vLLM's "triton_version") are not entries."""
    table = {int(key): value for key, value in configs.items() if key.isdigit()}
    return dict(table[min(table, key=lambda key: abs(key - num_rows))])


def peer_config(wheel: str, num_experts: int, inter: int, dtype: str, device_name: str, rows: int, *,
                hidden: int | None = None, triton_version: str | None = None) -> PeerConfig:
    """The engine's configs for `rows` routed rows of `num_experts` local experts of intermediate size `inter`
    on `device_name` (e.g. torch.cuda.get_device_name(): "NVIDIA H200"), `dtype` "bf16"/"fp16"/"fp32"/"fp8"
    (block-FP8 w8a8): the tuned file if the wheel has one, else the default rule (`hidden` = D, only the default
    rule's signature takes it). `triton_version` defaults to the installed Triton's."""
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    engine = engine_of(wheel)[0]
    up_file = find_config_file(wheel, engine.config_file_name(num_experts, inter, device_name, dtype), triton_version)
    if up_file is None:
        config = engine.default_config(wheel, rows, num_experts, inter, hidden or 0, dtype)
        return PeerConfig(config, dict(config), "default rule (get_default_config)", rows)
    up = _nearest(json.loads(read_member(wheel, up_file)), rows)
    down_file = find_config_file(wheel, engine.config_file_name(num_experts, inter, device_name, dtype, down=True),
                                 triton_version) if engine.has_down_configs else None
    down = _nearest(json.loads(read_member(wheel, down_file)), rows) if down_file else dict(up)
    up.pop("USE_TMA", None)  # the TMA variants are not reproduced
    down.pop("USE_TMA", None)
    down["BLOCK_SIZE_M"] = up["BLOCK_SIZE_M"]  # one align for both GEMMs (as try_get_optimal_moe_config forces)
    source = up_file.rsplit("/configs/", 1)[1] + (f" + {down_file.rsplit('/', 1)[1]}" if down_file else "")
    return PeerConfig(up, down, source, rows)
