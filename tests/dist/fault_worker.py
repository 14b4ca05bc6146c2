"""torchrun worker of the fault tests: one rank disagrees or fails; EVERY rank must raise a coded error, fast.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/dist/fault_worker.py --out OUT_DIR

Only the public ``MegaMoE`` is used. For each case of ``CASES`` every rank writes one line to
``OUT_DIR/rank{r}.jsonl`` as soon as the case ends (``{"case", "code", "message", "seconds", "next_ok"}``), so
the pytest side sees which ranks reported even when a rank hangs, and fails the case then. The process group's
own timeout (``GROUP_TIMEOUT_S``) is far above the 10 s a case may take, so a case passes only when the layer
itself turned the fault into an error on every rank. ``next_ok``: after the error, a correct call on every
rank gave the single-process reference's output (the layer is usable again, nothing paired with a stale call).
The last case kills one rank mid-run (``--kill``): the survivors must report a coded error too.
``ORDER_CASES`` (run after ``CASES`` when not compiling): ranks call two layers out of step (crossed at their first
call, crossed later, an MTP-like layer called on one rank only) or one rank destroys a layer alone; every rank must
raise ENV004 / ENV017 before any row moves, and the next call in step must be correct.
``--stop-calling TRANSPORT`` runs one case alone, the layer on an EP group made with a ``STOP_TIMEOUT_S`` timeout
(``new_group(timeout=...)``; WORLD keeps 120 s): the last rank stays alive but stops calling the layer; the others
must raise ENV018 within that timeout, naming it (the layer's own gloo group inherits the EP group's timeout).
``--compile BACKEND`` runs the cases that call a layer with every call going through
``torch.compile(..., fullgraph=True, dynamic=True, backend=BACKEND)`` (the layer as one custom op).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from launch import join_group  # noqa: E402  (tests/dist, beside this worker)
from moe_ref import MegaMoE
from moe_ref.core.config import preset
from moe_ref.core.errors import MoERefError
from moe_ref.reference import reference_moe
from moe_ref.core.weights import MoEWeights

GROUP_TIMEOUT_S = 120
STOP_TIMEOUT_S = 2  # the timeout of the EP group of the --stop-calling launch (WORLD keeps GROUP_TIMEOUT_S)
STOP_AWAY_S = 8  # how long the last rank stays away there: far past the timeout, so waiting for it shows
PRESET = "tiny-kimi-k2"
CAP = 16


def _layer(rank: int, group=None, **overrides) -> MegaMoE:
    options = dict(num_max_tokens_per_rank=CAP, overflow="chunk", transport="symm", seed=3)
    options.update(overrides)
    return MegaMoE(PRESET, dist.group.WORLD if group is None else group, **options)


def _tokens(rank: int, num_tokens: int = 12) -> torch.Tensor:
    cfg = preset(PRESET)
    return torch.randn(num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(100 + rank))


class CompiledLayer:
    """``layer`` called through torch.compile (fullgraph, dynamic shapes); every other attribute is the layer's."""

    def __init__(self, layer: MegaMoE, backend: str):
        self.layer = layer
        self.compiled = torch.compile(lambda x, max_num_tokens=None: layer(x, max_num_tokens=max_num_tokens),
                                      fullgraph=True, dynamic=True, backend=backend)

    def __call__(self, x, max_num_tokens=None):
        return self.compiled(x, max_num_tokens=max_num_tokens)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def _next_call_ok(layer: MegaMoE, rank: int) -> bool:
    """A correct call on every rank after the fault: the output equals the one-process reference."""
    x = _tokens(rank)
    with torch.no_grad():
        y = layer(x)
    expected = reference_moe(x, MoEWeights.random(layer.cfg, seed=3), layer.cfg)
    return bool(torch.allclose(y, expected, atol=1e-5, rtol=1e-4))


def _on(rank: int, target: int, bad, good):
    return bad if rank == target else good


def case_overflow(rank, world):
    return _layer(rank, overflow=_on(rank, 0, "error", "chunk")), None


def case_transport(rank, world):
    return _layer(rank, transport=_on(rank, world - 1, "a2a", "symm")), None


def case_fp8(rank, world):
    return _layer(rank, dispatch_fp8=_on(rank, 0, True, False)), None


def case_backend(rank, world):
    return _layer(rank, experts_backend=_on(rank, 0, "grouped_mm", "torch")), None


def case_model_size(rank, world):
    cfg = preset(PRESET)
    other = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size + 8)
    return MegaMoE(_on(rank, world - 1, other, cfg), dist.group.WORLD, num_max_tokens_per_rank=CAP, seed=3), None


def case_cap(rank, world):
    return _layer(rank, num_max_tokens_per_rank=CAP + rank), None


def _call_with(make_input):
    def run(layer, rank, world):
        with torch.no_grad():
            layer(*make_input(rank, world))
    return run


def call_nan(layer, rank, world):
    x = _tokens(rank)
    if rank == world - 1:
        x[5, 3] = float("nan")
    with torch.no_grad():
        layer(x)


def call_dtype(layer, rank, world):
    with torch.no_grad():
        layer(_tokens(rank).to(_on(rank, 0, torch.bfloat16, torch.float32)))


def call_width(layer, rank, world):
    x = _tokens(rank)
    with torch.no_grad():
        layer(x[:, :-1] if rank == world - 1 else x)


def call_bound(layer, rank, world):
    with torch.no_grad():
        layer(_tokens(rank), max_num_tokens=_on(rank, 0, 64, None))


def call_overflow(layer, rank, world):
    with torch.no_grad():
        layer(_tokens(rank, _on(rank, world - 1, CAP + 1, 3)))


def call_experts_raise(layer, rank, world):
    if rank == 0:
        experts = layer.experts
        original = experts.forward

        def boom(*args, **kwargs):
            experts.forward = original  # only this call fails
            raise MemoryError("injected out-of-memory inside rank 0's experts")
        experts.forward = boom
    with torch.no_grad():
        layer(_tokens(rank))


def call_grad(layer, rank, world):
    x = _tokens(rank).requires_grad_(rank == 0)
    layer(x)


_HELD: dict = {}


def build_after_uneven_destroy(rank, world):
    """Two layers share the group's buffer; rank 0 destroys both, the others one: the buffer is gone on rank 0 only."""
    first, second = _layer(rank), _layer(rank)
    with torch.no_grad():
        first(_tokens(rank))
        second(_tokens(rank))
    first.destroy()
    if rank == 0:
        second.destroy()
    else:
        _HELD["second"] = second
    return _layer(rank), None


def call_then_release(layer, rank, world):
    try:
        with torch.no_grad():
            layer(_tokens(rank))
    finally:  # the ranks agree again: the next call allocates the buffer on every rank
        held = _HELD.pop("second", None)
        if held is not None:
            held.destroy()


def build_unloaded(rank, world):
    return _layer(rank, seed=_on(rank, 0, None, 3)), None


def _named_layer(rank: int, group=None, **overrides) -> MegaMoE:
    """A layer whose constructor claimed its index in build order on the group (``EPOptions.layer_index``): the
    identity the per-call agreement compares (the out-of-order cases fail without it)."""
    layer = _layer(rank, group, **overrides)
    assert layer.options.layer_index is not None, "MegaMoE did not claim its layer index"
    return layer


def _two_layers(transport: str, called_before: int):
    """Layer A (returned) and layer B (held), same plan; the first ``called_before`` of them (0, 1 or 2) are called
    once on every rank before the case (their routed steps built)."""
    def build(rank, world):
        layers = [_named_layer(rank, transport=transport), _named_layer(rank, transport=transport)]
        with torch.no_grad():
            for layer in layers[:called_before]:
                layer(_tokens(rank))
        _HELD["second"] = layers[1]
        return layers[0], None
    return build


def call_crossed(layer, rank, world):
    """Rank 0 calls layer A, the others layer B (at the same count of their own layer)."""
    try:
        with torch.no_grad():
            (layer if rank == 0 else _HELD["second"])(_tokens(rank))
    finally:
        _HELD.pop("second").destroy()


def call_second_on_rank_0(layer, rank, world):
    """Rank 0 calls layer B for the first time (an MTP layer run on some ranks only); the others layer A again."""
    try:
        with torch.no_grad():
            (_HELD["second"] if rank == 0 else layer)(_tokens(rank))
    finally:
        _HELD.pop("second").destroy()


def build_destroyed_on_rank_0(transport: str):
    def build(rank, world):
        layer = _named_layer(rank, transport=transport)
        with torch.no_grad():
            layer(_tokens(rank))
        if rank == 0:
            layer.destroy()  # its next call builds the step again; the others' next call uses theirs
        return layer, None
    return build


def call_then_destroy_everywhere(layer, rank, world):
    try:
        with torch.no_grad():
            layer(_tokens(rank))
    finally:  # the ranks agree again: the next call builds the step on every rank
        layer.destroy()


# name, build (None: the default layer), call (None: construction is the case), the rank at fault (0 or -1 for
# the last), the code expected there, the code expected on every other rank.
CASES = [
    ("overflow_differs", case_overflow, None, 0, "CFG008", "CFG008"),
    ("transport_differs", case_transport, None, -1, "CFG008", "CFG008"),
    ("dispatch_fp8_differs", case_fp8, None, 0, "CFG008", "CFG008"),
    ("experts_backend_differs", case_backend, None, 0, "CFG008", "CFG008"),
    ("model_size_differs", case_model_size, None, -1, "CFG008", "CFG008"),
    ("cap_differs", case_cap, None, -1, "CAP002", "CAP002"),
    ("max_num_tokens_on_one_rank", None, call_bound, 0, "CFG008", "CFG008"),
    ("nan_input_on_one_rank", None, call_nan, -1, "INP004", "INP004"),
    ("wrong_dtype_on_one_rank", None, call_dtype, 0, "INP002", "INP002"),
    ("wrong_width_on_one_rank", None, call_width, -1, "INP001", "INP001"),
    ("over_cap_under_error", None, call_overflow, -1, "CAP001", "CAP001"),
    ("exception_in_experts", None, call_experts_raise, 0, "MemoryError", "ENV005"),
    ("gradient_requested_on_one_rank", None, call_grad, 0, "INP007", "INP007"),
    ("weights_not_loaded_on_one_rank", build_unloaded, _call_with(lambda r, w: (_tokens(r),)), 0, "INP006", "INP006"),
    ("shared_buffer_destroyed_on_one_rank", build_after_uneven_destroy, call_then_release, 0, "CFG008", "CFG008"),
]
# Calls out of step, in CASES' format, over both transports (not run under --compile: they add nothing below the op).
ORDER_CASES = [case for transport in ("symm", "a2a") for case in (
    (f"layers_crossed_at_first_call_{transport}", _two_layers(transport, 0), call_crossed, 0, "ENV004", "ENV004"),
    (f"layers_crossed_after_first_calls_{transport}", _two_layers(transport, 2), call_crossed, 0, "ENV004", "ENV004"),
    (f"layer_called_on_one_rank_only_{transport}", _two_layers(transport, 1), call_second_on_rank_0, 0, "ENV004",
     "ENV004"),
    (f"step_destroyed_on_one_rank_{transport}", build_destroyed_on_rank_0(transport), call_then_destroy_everywhere, 0,
     "ENV017", "ENV017"),
)]


def _code(err: BaseException) -> str:
    return err.code if isinstance(err, MoERefError) else type(err).__name__


def run_case(name, build, call, rank, world, compile_backend: str | None = None) -> dict:
    start = time.perf_counter()
    layer, code, message = None, None, ""
    try:
        if build is not None:
            layer, _ = build(rank, world)
        else:
            layer = _layer(rank, overflow="error" if name == "over_cap_under_error" else "chunk")
        if compile_backend is not None:
            torch._dynamo.reset()  # a fresh compile per case (dynamo stops recompiling one function after 8)
            layer = CompiledLayer(layer, compile_backend)
        if call is not None:
            call(layer, rank, world)
    except BaseException as err:  # noqa: BLE001 - the error IS the result
        code, message = _code(err), str(err)
    seconds = time.perf_counter() - start
    next_ok = None
    if layer is not None and call is not None:  # the same layer must work again, on every rank
        if name == "weights_not_loaded_on_one_rank" and rank == 0:
            layer.load_weights(MoEWeights.random(layer.cfg, seed=3))
        try:
            next_ok = _next_call_ok(layer, rank)
        except BaseException as err:  # noqa: BLE001
            next_ok, message = False, message + f" | next call: {_code(err)} {err}"
    if layer is not None:
        layer.destroy()
    return {"case": name, "code": code, "message": message[:600], "seconds": round(seconds, 3), "next_ok": next_ok}


def stop_calling(out_dir: str, transport: str) -> int:
    """The last rank stays alive but makes no call for ``STOP_AWAY_S``; the others call the layer once more."""
    rank, world, report = join_group(out_dir, GROUP_TIMEOUT_S)
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=STOP_TIMEOUT_S))
    dist.barrier()  # ranks start the case together (WORLD's timeout: a slow start is no failure)
    layer = _named_layer(rank, group, transport=transport)
    with torch.no_grad():
        layer(_tokens(rank))
    dist.barrier()
    back = time.time() + STOP_AWAY_S  # one moment for every rank (one host)
    start = time.perf_counter()
    code, message = None, "stayed alive without calling the layer"
    if rank != world - 1:
        try:
            with torch.no_grad():
                layer(_tokens(rank))
        except BaseException as err:  # noqa: BLE001 - the error IS the result
            code, message = _code(err), str(err)
    else:
        time.sleep(STOP_AWAY_S)
    report({"case": "peer_stops_calling", "code": code, "message": message[:600],
            "seconds": round(time.perf_counter() - start, 3), "next_ok": None})
    # every rank stays alive until the absent one is back: a rank that left early would end its peers' waits
    # with a closed connection (ENV005) instead of the timeout under test
    time.sleep(max(0.0, back - time.time()))
    os._exit(0)  # the group's collectives are out of step after a timeout: no clean teardown


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="store_true", help="end with the dead-peer case")
    parser.add_argument("--compile", default=None, choices=["aot_eager", "inductor"],
                        help="call the layers through torch.compile with this backend (the cases that call one)")
    parser.add_argument("--stop-calling", default=None, choices=["symm", "a2a"],
                        help="run only the case of a live peer that stops calling, over this transport")
    args = parser.parse_args()
    if args.stop_calling is not None:
        return stop_calling(args.out, args.stop_calling)
    rank, world, report = join_group(args.out, GROUP_TIMEOUT_S)
    for name, build, call, *_ in CASES + (ORDER_CASES if args.compile is None else []):
        if args.compile is not None and call is None:
            continue  # construction cases: nothing is called, so nothing is compiled
        report(run_case(name, build, call, rank, world, args.compile))
        dist.barrier()  # cases start together (not part of what is measured)
    if args.kill:
        # torchrun SIGTERMs the survivors as soon as it sees a dead worker: ignore that here, so each survivor
        # must end the case by itself (the layer's coded error), not be rescued by the launcher.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        layer = _layer(rank)
        with torch.no_grad():
            layer(_tokens(rank))
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies between two calls; the peers' next call must fail fast
        start = time.perf_counter()
        code, message = None, ""
        try:
            with torch.no_grad():
                layer(_tokens(rank))
        except BaseException as err:  # noqa: BLE001
            code, message = _code(err), str(err)
        report({"case": "dead_peer", "code": code, "message": message[:600],
                "seconds": round(time.perf_counter() - start, 3), "next_ok": None})
        os._exit(0)  # the group has a dead member: no clean teardown
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
