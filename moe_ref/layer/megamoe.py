"""``MegaMoE``: the drop-in expert-parallel MoE block (torch.nn.Module). Its forward steps are numbered in the class
docstring; each concern lives beside it in ``moe_ref.layer``:

    construction.py   the config (``as_config``), the arguments' types, the construction's one collective
    weights.py        parameters, loading (load_weights, load_hf_weights, state_dict), the fixed dtype and device
    calls.py          step 1 of a call: this rank's problem with it (not raised: the routed step agrees on it)
    runtime.py        experts, routed step and eager graphs: built on first use, rebuilt after a load, released by
                      ``destroy()`` and at exit, left out of pickles

Parameters (this rank's experts only; e = E / ep_size): ``gate_weight [E, D]``,
``e_score_correction_bias [E]`` (fp32 buffer, sigmoid families), ``gate_up_weight [e, 2F, Dx]``,
``down_weight [e, Dx, F]``, shared ``shared_gate_up_weight [2S, D]``, ``shared_down_weight [D, S]``,
Kimi-K3 ``latent_down_weight [L, D]``, ``latent_up_weight [D, L]``, ``latent_norm_weight [L]``.

The routed experts are allocated when they are loaded, in the form they are loaded in: plain weights become
``gate_up_weight``/``down_weight`` in the layer's dtype; a quantized checkpoint (FP8 blocks, INT4, MXFP4; see
``load_hf_weights``) is kept as stored in ``quantized_experts`` and the two parameters stay None. So the device
holds the checkpoint's bytes of the local experts and never a bf16 copy of them (``expert_nbytes()``), and a layer
that was never loaded holds none (a call then raises INP006 on every rank without allocating them). The W4A16
kernel reads INT4/MXFP4 words in its own nibble order: at load the layer rewrites its copy in place
(``QuantizedExpertWeights.with_group_planes``; the kernel adds a block-major copy of the scales, 1/16 of INT4's
bytes); the FP8 kernels read gate/up rows interleaved in 128-row blocks, which the layer also rewrites in place
(``QuantizedExpertWeights.with_interleaved_gate_up``); ``state_dict()`` puts both back in the checkpoint's order.

nn.Module conventions: ``state_dict()``/``load_state_dict()`` round trip into a fresh (unseeded) layer, strict:
plain experts are allocated by the load, quantized ones travel as ``quantized_experts.<field>`` tensors (+ their
format) and are kept as stored; a partial state dict (``strict=False``) leaves what it lacks unwritten, and calls
raise INP006 until a load writes it. The dtype and device are fixed at construction (plan, buffers, experts,
checks): ``.to(dtype)``, ``.half()``, ``.float()``, ``.cuda()``... that would change them raise
``LayerConversionError`` (CFG016); build a layer with the dtype/device wanted and ``load_state_dict`` this one's
weights into it. ``pickle``/``torch.save(layer)``/``copy.deepcopy`` keep the config, options and weights and leave
out the runtime objects (the copy builds its own on its first call); a layer over a process group refuses (CFG020).

Inference mode and autograd: the step's buffers are built outside inference mode, so calls in and out of
``torch.inference_mode()`` mix in any order. The layer has no backward: with grad mode on and an input or
parameter requiring grad, every rank raises ``GradientNotSupportedError`` (INP007); grad mode is left as it was,
also when a call raises under ``torch.compile``.

Shape legend: T tokens of this rank, K top-k, E experts, e local experts, D hidden width, Dx expert input width,
F expert intermediate, S shared-MLP intermediate, L latent width.
"""
from __future__ import annotations

import functools
import os
import traceback
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from moe_ref import custom_ops
from moe_ref.block import expert_input, finish, route_unchecked
from moe_ref.core.config import MoEConfig, ParallelConfig
from moe_ref.core.weights import MoEWeights
from moe_ref.eager_graphs import EagerGraphs
from moe_ref.ep.device_checks import DeviceChecks
from moe_ref.ep.distributed import claim_layer_index, group_size_and_rank
from moe_ref.ep.options import EPOptions
from moe_ref.ep.routed_step import RoutedStep
from moe_ref.eplb import mover as eplb_mover
from moe_ref.eplb import slots as eplb_slots
from moe_ref.eplb import telemetry as eplb_telemetry
from moe_ref.experts import Experts
from moe_ref.layer import calls, construction, pretrained, runtime
from moe_ref.layer import weights as layer_weights


class MegaMoE(nn.Module):
    """The expert-parallel MoE block of every registered family (``moe_ref.core.families``).

    Construction is collective over ``group``: every rank must build the layer with the same config and
    options (checked in one collective; a difference raises ``GroupDisagreementError`` (CFG008), or
    ``CapacityMismatchError`` (CAP002) for the cap, on every rank, naming each rank's value).

    forward(x [T, D]), collective (every rank calls it, with T = 0 if it has no tokens):
      1. this rank's problem with the call: x's shape, dtype, device; weights not all loaded; a gradient requested;
         a max_num_tokens that is no count (``moe_ref.layer.calls``)              -> a problem, not raised yet
      2. route: gate GEMM in fp32, family top-k (block.route_unchecked)          -> topk_ids [T, K], topk_weights [T, K]
         (NaN/inf logits are a problem too: a device-side check, read in step 4's collective)
      3. (Kimi-K3) latent down-projection (block.expert_input)                   -> z [T, Dx]
      4. the routed step (moe_ref.ep.routed_step): ONE small collective agrees on every rank's problem, device-side
         checks and row count (a coded error on every rank, or n chunks), then per chunk
         dispatch -> experts -> combine -> reduce                                -> routed [T, Dx]
         (with a problem from step 1, steps 2-3 are skipped and the step only raises it on every rank)
      5. (Kimi-K3) RMSNorm over the full cross-rank sum, latent up; + shared experts (block.finish) -> y [T, D]
    One rank on CUDA: steps 2-5 of a token count's later calls replay one CUDA graph (moe_ref.eager_graphs).
    Under ``torch.compile`` steps 1-5 are one custom op (``moe_ref.custom_ops``: no graph break).

    Args:
        cfg: ``MoEConfig``, a preset name (``"kimi-k2"``...), an HF config.json path or dict, or ``model.config``.
        group: the EP process group (``dist.group.WORLD``...), or None for one process.
        num_max_tokens_per_rank: the cap: rows ONE rank feeds per call (``MOE_REF_NUM_MAX_TOKENS_PER_RANK``, else
            4096).
        overflow: ``"error"`` or ``"chunk"`` when a rank's batch exceeds the cap (``MOE_REF_OVERFLOW_POLICY``, else
            error).
        transport: ``"auto"``, ``"symm"``, ``"a2a"`` or ``"local"`` (default: ``MOE_REF_TRANSPORT``, else auto).
        experts_backend: ``"auto"``, ``"torch"``, ``"grouped_mm"``, ``"triton"``, ``"deep_gemm"`` (default:
            ``MOE_REF_EXPERTS_BACKEND``, else auto: torch on CPU; on CUDA, per call the backend a measured table ranks
            fastest for the call's regime among those installed, Triton where the table has no entry for this GPU class
            or DeepGEMM is absent; ``moe_ref.experts.auto``, ``moe-ref info`` prints the table). One that cannot run
            here (not installed; Triton off CUDA outside ``TRITON_INTERPRET=1``) raises ENV001 at once.
        dispatch_fp8: tokens move as FP8 e4m3 with per-128 scales (half the bytes; lossy); a backend with fp8 weights
            (``supports_fp8``: triton, deep_gemm) runs them, quantized once to 128x128 blocks, on the FP8 pool as is;
            torch and grouped_mm run the dequantized pool with the layer's weights.
        dtype, device: of the parameters; inputs must match them (``'cpu:N'`` is ``'cpu'``).
        alignment: rows each expert segment of the receive pool is aligned to; None (default): the backend's
            ``segment_alignment`` (torch 128, grouped_mm 16, triton 1, deep_gemm 128, auto 128 when it holds deep_gemm).
        pool_format: ``"contiguous"`` (default: ``MOE_REF_POOL_FORMAT``, else contiguous; segments back to back, the
            fewest rows) or ``"masked"`` (decode with a small cap: each local expert owns ``align(R * cap, alignment)``
            rows at a fixed start, DeepGEMM's masked layout, so ``deep_gemm`` experts run its masked GEMMs;
            ``moe-ref plan --pool-format masked`` prints the bytes).
        seed: an int: ``MoEWeights.random(cfg, seed)`` weights (the same on every rank); None: uninitialised, and a
            call raises ``WeightsNotLoadedError`` (INP006) until a load (``load_hf_weights``, ``load_weights``,
            ``load_state_dict``).
        mega: the routed step's engine: ``"off"`` (default: moe_ref's transport + experts backend), ``"deep_gemm"``
            (DeepGEMM's SM90 FP8 fused mega-MoE; ENV001/ENV002 on every rank when it cannot run), or ``"auto"``
            (deep_gemm where every rank accepts the shape and machine, else moe_ref's own path; a warning says why).
        debug_checks: per-call checks that nothing is lost (default: ``MOE_REF_DEBUG_CHECKS``, else off).
        eager_graph_max_tokens: one rank on CUDA: eager calls of 1 .. this many tokens replay a CUDA graph of their
            token count, captured on its second call (``moe_ref.eager_graphs``; default:
            ``MOE_REF_EAGER_GRAPH_MAX_TOKENS``, else ``min(1024, num_max_tokens_per_rank)``); 0: every call launches its
            kernels from Python.
        batch_invariant: a token's output bits do not depend on its batch, row order, chunks or the EP size (default:
            ``MOE_REF_BATCH_INVARIANT``, else off; docs/batch_invariance.md; CFG026 for options that cannot hold it).
        num_redundant_experts, placement: EPLB (docs/eplb.md): Ph = E + redundant physical expert slots, Ph / R per
            rank, each holding the logical expert ``placement`` (a one-layer ``moe_ref.eplb.Placement`` or its file;
            None: the planner's for an even load) names; the routed step counts slots. Both None: no EPLB.

    Attributes:
        options: the resolved ``EPOptions``. uses_mega: the agreed engine choice. routed_step: the one
            ``RoutedStep`` (built on first use). num_local_experts, first_local_expert, rank, world_size.
    """

    def __init__(self, cfg: MoEConfig | str | os.PathLike | Mapping[str, Any], group: dist.ProcessGroup | None = None,
                 *, num_max_tokens_per_rank: int | None = None, overflow: str | None = None,
                 transport: str | None = None, experts_backend: str | None = None, dispatch_fp8: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", alignment: int | None = None,
                 seed: int | None = None, mega: str | None = None, debug_checks: bool | None = None,
                 pool_format: str | None = None, eager_graph_max_tokens: int | None = None,
                 batch_invariant: bool | None = None,
                 num_redundant_experts: int | None = None, placement=None):
        super().__init__()
        self.cfg = cfg = construction.as_config(cfg)
        construction.check_group(group)
        self.options = EPOptions.resolve(
            num_max_tokens_per_rank=num_max_tokens_per_rank, overflow=overflow, transport=transport,
            experts_backend=experts_backend, dispatch_fp8=dispatch_fp8, alignment=alignment, pool_format=pool_format,
            mega=mega, dtype=dtype, device=construction.layer_device(device), debug_checks=debug_checks,
            eager_graph_max_tokens=eager_graph_max_tokens, layer_index=claim_layer_index(group),
            batch_invariant=batch_invariant)
        self.group = group
        self.world_size, self.rank = group_size_and_rank(group)
        # EPLB: e = Ph / R physical slots here, numbered rank * e ...; a problem is raised by the agreement below
        self.expert_slots, slots_problem = eplb_slots.resolve_slots(cfg, self.world_size, self.rank,
                                                                    num_redundant_experts, placement, self.options.device)
        self.num_local_experts = (self.expert_slots.num_local if self.expert_slots is not None else 0 if slots_problem
                                  else ParallelConfig(ep_size=self.world_size).num_local_experts(cfg))
        self.first_local_expert = self.rank * self.num_local_experts
        slot_fields = {} if self.expert_slots is None else {"eplb.placement": eplb_slots.placement_digest(
            self.expert_slots.placement)}
        self.uses_mega = construction.agree_on_construction(
            cfg, self.options, group, construction.local_problem(seed, self.options, cfg) or slots_problem,
            self._mega_supported_here(), extra_fields=slot_fields)
        runtime.start(self)
        layer_weights.register_parameters(self)
        if self.expert_slots is not None:  # the slot map travels with the weights in state_dict
            self.register_buffer("expert_slot_map", self.expert_slots.map_Ph)
        if seed is not None:
            self.load_weights(MoEWeights.random(cfg, seed=seed, dtype=self.options.dtype))

    # --- the call ------------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, *, max_num_tokens: int | None = None) -> torch.Tensor:
        """``hidden_states [T, D]`` -> ``[T, D]`` in the same dtype (collective; see the class docstring's steps).
        Under ``torch.compile`` the whole layer is one custom op (``moe_ref.custom_ops``); otherwise ``eager_forward``.
        """
        if torch.compiler.is_compiling():
            # the op has no autograd formula: whether a gradient is asked for is decided here (dynamo guards on it),
            # and the op gets a detached input, never a no_grad() block: see custom_ops on why
            x = hidden_states.detach() if isinstance(hidden_states, torch.Tensor) else hidden_states
            return torch.ops.moe_ref.mega_moe(x, self._op_calls, self._op_id, custom_ops.encode_bound(max_num_tokens),
                                              calls.grad_requested(self, hidden_states))
        return self.eager_forward(hidden_states, max_num_tokens=max_num_tokens)

    def eager_forward(self, hidden_states: torch.Tensor, *, max_num_tokens: int | None = None,
                      grad_requested: bool | None = None, read_checks_now: bool = False) -> torch.Tensor:
        """The layer's work (see ``forward``).

        Args:
            hidden_states: ``[T, D]`` in the layer's dtype, on its device.
            max_num_tokens: a bound on T promised for every rank (checked in the per-call collective; give it
                on every rank or on none).
            grad_requested: decided by the caller (the compiled op, which runs without autograd), else here.
            read_checks_now: read this call's device checks before returning, also where they are otherwise read by
                a later call (one rank on CUDA); the compiled op asks for it (see ``moe_ref.custom_ops``).

        At decode on CUDA, a call can be captured in a CUDA graph (``torch.cuda.graph``) and replayed with new
        inputs of the same shape (the ``symm`` transport; see ``moe_ref.ep.routed_step`` for what capture skips).

        Raises, on every rank alike: this or any rank's input problem (INP001-INP008), CAP001 under
        ``overflow='error'``, ENV004/ENV005/CFG008 (see ``moe_ref.ep.routed_step``).
        """
        try:
            return self._eager_forward(hidden_states, max_num_tokens, grad_requested, read_checks_now)
        except BaseException as err:
            # the routed step keeps the failure it agrees on in a local: frame -> exception -> traceback -> frame is a
            # cycle holding the step, its shared buffer and this layer until gc (a layer dropped on every rank would
            # stay held on the failing rank only: CFG008 at the next build). The finished frames' locals go, not
            # their lines
            traceback.clear_frames(err.__traceback__.tb_next)
            raise

    def _eager_forward(self, x_TD: torch.Tensor, max_num_tokens: int | None, wants_grad: bool | None,
                       read_checks_now: bool) -> torch.Tensor:
        problem = calls.input_problem(self, x_TD, wants_grad)  # step 1
        bad_bound = calls.bound_problem(max_num_tokens)
        if bad_bound is not None:  # raised on every rank by the step's collective (no bound of this rank in it)
            problem, max_num_tokens = bad_bound, None
        step = self.routed_step
        if problem is not None:  # step 4 with no rows: the step's collective raises it on every rank
            empty = torch.empty(0, self.cfg.num_topk, device=self.options.device)
            step(torch.empty(0, self.cfg.expert_hidden_size, dtype=self.options.dtype, device=self.options.device),
                 empty.long(), empty, problem=problem, max_num_tokens=max_num_tokens)
            raise AssertionError("unreachable: the routed step raises the agreed problem")
        runtime.warm_up(self, step, lambda x_warm_TD: self._device_work(x_warm_TD, step, None))
        graphs = runtime.eager_graphs_for(self, step)
        if graphs is not None and not read_checks_now and graphs.covers(x_TD, max_num_tokens):
            replayed = graphs(x_TD, step, lambda x_graph_TD: self._device_work(x_graph_TD, step, DeviceChecks()))
            if replayed is not None:
                return replayed
        # a user's own CUDA-graph capture reads no device checks: none are computed there
        checks = None if step.capturing() else DeviceChecks()
        y_TD, _ = self._device_work(x_TD, step, checks, max_num_tokens, read_checks_now)
        return y_TD

    def _device_work(self, x_TD: torch.Tensor, step: RoutedStep, checks: DeviceChecks | None,
                     max_num_tokens: int | None = None, read_checks_now: bool = False
                     ) -> tuple[torch.Tensor, DeviceChecks | None]:
        """Steps 2-5: ``(y_TD [T, D], checks)``. ``checks`` collects the device-side checks (NaN logits, routing
        values; read in the routed step's one collective, or by a later call on one rank on CUDA); None computes
        none (inside a user's CUDA-graph capture). Raises only the routed step's agreed errors."""
        moe_weights = self.weights()
        (topk_ids_TK, topk_weights_TK), _ = route_unchecked(  # step 2
            x_TD, self.gate_weight, self.cfg, self.e_score_correction_bias, router_bias_E=self.router_bias,
            check_values=checks is not None,
            device_checks=checks, batch_invariant=self.options.batch_invariant)
        if self.expert_slots is not None:  # logical ids -> the replica serving each (token, k), on the device
            topk_ids_TK = self.expert_slots.to_physical(x_TD, topk_ids_TK)
        invariant = self.options.batch_invariant
        routed_TDx = step(expert_input(x_TD, moe_weights, self.cfg, batch_invariant=invariant),  # steps 3-4
                          topk_ids_TK, topk_weights_TK, max_num_tokens=max_num_tokens, device_checks=checks,
                          read_checks_now=read_checks_now)
        return finish(routed_TDx, x_TD, moe_weights, self.cfg, batch_invariant=invariant), checks  # step 5

    # --- runtime objects (moe_ref.layer.runtime) ------------------------------------------------------------------
    @property
    def experts(self) -> Experts:
        """This rank's experts backend, built on first use from the loaded weights (quantized or plain); while some
        are missing, a stand-in holding no memory (``runtime.UnloadedExperts``)."""
        if self._experts is None:
            self._experts = runtime.build_experts(self)
        return self._experts

    @property
    def fp8_experts(self) -> bool:
        """FP8 expert weights: with ``dispatch_fp8`` on a backend that has them (triton, deep_gemm)."""
        return runtime.fp8_experts(self)

    @property
    def routed_step(self) -> RoutedStep:
        """The layer's one routed step (collective to build: every rank builds it on its first call)."""
        if self._routed_step is None:
            self._routed_step = runtime.build_routed_step(self)
        return self._routed_step

    @property
    def eager_graphs(self) -> EagerGraphs | None:
        """The CUDA graphs eager calls replay (``moe_ref.eager_graphs``; ``captures``, ``len()``), or None: before the
        first call, and where calls replay none (several ranks, the CPU, debug_checks, eager_graph_max_tokens=0)."""
        return self._graphs

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """``[e]`` int64: rows each local expert (EPLB: slot) received, summed over all calls (for load balancers)."""
        return self.routed_step.num_recv_tokens_per_expert

    # --- EPLB (moe_ref.eplb, docs/eplb.md) --------------------------------------------------------------------------
    def expert_load(self) -> "eplb_telemetry.ExpertLoad":
        """Rows each physical slot received since the last ``reset_expert_load`` (or build, or rebalance), gathered
        from every rank: per slot, per rank, balancedness, max-rank rows (collective; one host sync)."""
        return eplb_telemetry.gather_expert_load(self._slots(), self.num_recv_tokens_per_expert, self.group)

    def reset_expert_load(self) -> None:
        """Start a new telemetry window (call on every rank; no host sync)."""
        if self._routed_step is not None:
            self._slots().reset_window(self.num_recv_tokens_per_expert)

    def rebalance(self, placement) -> None:
        """Move the experts to ``placement`` (a one-layer ``Placement`` or its file, the same on every rank):
        collective over the EP group, called between calls of the layer on every rank (``moe_ref.eplb.mover``).
        Raises, on every rank: CFG023/CFG033 (misfit), CFG024 (ranks given different placements), ENV019 (canary)."""
        eplb_mover.rebalance_slots(self._slots(), placement, layer_weights.local_expert_tensors(self), self.group)
        runtime.weights_changed(self)
        self.reset_expert_load()

    def _slots(self) -> "eplb_slots.ExpertSlots":
        if self.expert_slots is None:
            raise eplb_slots.ExpertSlotsError("this MegaMoE was built without EPLB; build it with "
                                              "num_redundant_experts=N and/or placement=... for physical slots")
        return self.expert_slots

    def check(self) -> None:
        """Wait for the calls made so far and raise the first device check they failed (routing values, NaN
        logits). Needed only on one rank on CUDA, where a call does not wait for its checks and a failed one is
        raised by the next call; elsewhere each call raises its own. NOTE: syncs the host."""
        if self._routed_step is not None:
            self._routed_step.check()

    def destroy(self) -> None:
        """Release the routed step and its share of the group's symmetric buffer (not collective: call it on every
        rank; the layer stays usable, the next call builds the step again). Done for every live layer at exit
        anyway (``runtime.release_all_at_exit``), so call it only to free memory early."""
        runtime.destroy(self)

    # seams (tests patch them): whether the fused engine can run here; allocating plain experts
    def _mega_supported_here(self) -> tuple[bool, str]:
        if self.expert_slots is not None:
            return False, "EPLB's physical slots run on moe_ref's own EP path"
        return construction.mega_supported_here(self.cfg, self.options, self.world_size)

    def _expert_parameters(self) -> tuple[nn.Parameter, nn.Parameter]:
        return layer_weights.expert_parameters(self)

    def __getstate__(self) -> dict:
        return runtime.picklable_state(self)  # CFG020 for a layer over a process group

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        runtime.start(self)

    # --- weights (moe_ref.layer.weights) ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, layer_idx: int, **options) -> "MegaMoE":
        """Build and load MoE layer ``layer_idx`` of a checkpoint folder, or of a repo id already in the local Hugging
        Face hub cache (offline), collectively over ``group=``; ``options``: this class's keyword options and
        ``group``, ``revision``, ``cache_dir``, ``prefix``, ``progress`` (``moe_ref.layer.pretrained``)."""
        return pretrained.from_pretrained(cls, name_or_path, layer_idx, **options)

    def weights(self) -> MoEWeights:
        """This rank's parameters as ``MoEWeights`` (views, no copy). The expert tensors are None unless the
        experts are held as plain parameters (not loaded yet, or kept quantized in ``quantized_experts``)."""
        return layer_weights.as_moe_weights(self)

    def expert_nbytes(self) -> int:
        """Bytes this rank's routed expert weights occupy on the device: the plain parameters, or a quantized
        checkpoint's tensors as stored (then equal to the checkpoint's bytes of these experts; 4-bit words may be in
        the W4A16 kernel's order, the same bytes); 0 before loading. Not counted: what a backend holds beside them
        (the W4A16 kernel's block-major scales, ``self.experts.extra_nbytes()``)."""
        return layer_weights.expert_nbytes(self)

    def load_weights(self, weights: MoEWeights) -> "MegaMoE":
        """Copy ``weights`` (all experts, or a block holding at least this rank's experts) into the parameters
        (the experts' are allocated here on the first plain load; quantized experts held before are dropped).

        Every shape is checked before anything is copied (``TensorShapeMismatchError``, LOAD002). With ``mega``
        in use this is collective (the fused engine is rebuilt from the new weights on the next call).
        """
        layer_weights.load_weights(self, weights)
        runtime.weights_changed(self)
        return self

    def load_hf_weights(self, path: str | os.PathLike, layer_idx: int, prefix: str | None = None, *,
                        progress: bool | None = None) -> "MegaMoE":
        """Load layer ``layer_idx`` from an HF safetensors checkpoint (file or folder), reading only this
        rank's experts (see ``moe_ref.checkpoint.loading.load_moe_weights`` for each family's names).

        With a ``quantization_config`` in the config.json beside it (FP8 128x128 blocks, compressed-tensors INT4 or
        MXFP4: ``moe_ref.checkpoint.formats``), the routed experts are read as stored into device tensors
        (``quantized_experts``; no plain copy is ever allocated) and run by the quantized backend matching
        ``experts_backend`` (``moe_ref.experts.quantized``: triton -> FP8 block / W4A16 kernels, torch -> the
        dequantizing loop). The router, shared experts and latent projections are read into the layer's dtype, each
        in the precision the ``quantization_config`` decides (``QuantSpec.quantizes``; FP8 shared experts are
        dequantized once, here). ``load_report()`` tells the bytes read and held.

        Args:
            path: a ``.safetensors`` file or a checkpoint folder.
            layer_idx: the decoder layer.
            prefix: the text before the layer number; None tries ``moe_ref.checkpoint.loading.KNOWN_PREFIXES``.
            progress: a bar over this rank's experts on stderr; None: rank 0, on a terminal (``MOE_REF_PROGRESS``).

        Raises:
            The loaders' LOAD* errors (LOAD014: a module stored in another precision than the config says);
            ``BackendUnavailableError`` (ENV001) for a quantized checkpoint with
            ``mega='deep_gemm'`` or an experts backend without quantized kernels (grouped_mm, deep_gemm).
        """
        self._load_report = layer_weights.load_hf_weights(self, path, layer_idx, prefix, progress)
        runtime.weights_changed(self)
        return self

    def load_report(self):
        """What the last ``load_hf_weights`` read and holds (``moe_ref.checkpoint.loading.LoadReport``), None
        before one: each weight's stored dtype/format, bytes read and bytes held; ``dequantized_bytes()`` gives
        the weights stored quantized (e.g. FP8 shared experts) as (bytes read, bytes held dequantized)."""
        return getattr(self, "_load_report", None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        layer_weights.save_quantized_experts(self, destination, prefix)  # quantized experts as stored

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # nn.Module's own: copies the parameters and buffers the state dict has
        load_module_tensors = functools.partial(super()._load_from_state_dict, state_dict, prefix, local_metadata,
                                                strict, missing_keys, unexpected_keys, error_msgs)
        if layer_weights.load_state_dict_into(self, load_module_tensors, state_dict, prefix, missing_keys,
                                              unexpected_keys, error_msgs):
            runtime.weights_changed(self)
        if self.expert_slots is not None:
            self.expert_slots.take_map()  # the state dict's slot map (CFG033 if it is no placement)

    def _apply(self, fn, recurse=True):
        layer_weights.check_conversion(self, fn)  # CFG016 for a change of dtype or device, before anything is converted
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return construction.describe(self, layer_weights.experts_precision(self, self.fp8_experts))
