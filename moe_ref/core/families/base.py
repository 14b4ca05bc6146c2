"""What a model family is, as data: the ``Family`` record and the small records it is made of.

    config.json --Family.hidden_size/num_experts/... (Key: field names + default)--> MoEConfig fields
    config.json --RouterRule / ExpertRule / SharedRule / MoELayers--> the block's math and its MoE layers
    checkpoint  --TensorLayout (one per published layout)--> the tensor names of one MoE layer

A fact is either a constant of the family (``scoring="softmax"``) or a ``Key``: the config.json field names that
hold it (the first present with a non-null value wins) and the family's default for a config.json that leaves it
out (the value the family's own configuration class uses). Sizes (D, E, K, F, a shared MLP's width) have no
default: a config.json without them is refused, since a configuration class's default size is some other model's.
``moe_ref.core.config`` reads a config.json through
these records; ``moe_ref.checkpoint.loading`` reads a checkpoint through ``TensorLayout``. Nothing here computes.

Shape legend: E experts, D hidden width, Dx expert input width (D, or the latent width for Kimi-K3), F expert
intermediate, S shared-MLP intermediate (all shared experts fused).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# topk_method (DeepSeek's config field) -> (selection bias, group score rule). "greedy" is a plain top-k (no
# groups); "group_limited_greedy" scores a group by its best expert (DeepSeek-V2); "noaux_tc" adds
# e_score_correction_bias for the selection and scores a group by the sum of its top-2 (DeepSeek-V3).
TOPK_METHODS: dict[str, tuple[bool, str | None]] = {
    "noaux_tc": (True, "top2_sum"), "group_limited_greedy": (False, "max"), "greedy": (False, None)}


@dataclass(frozen=True)
class Key:
    """A config.json fact: the first of ``names`` present with a non-null value, else ``default``.

    ``default=None`` means required: a config.json without it is refused (CFG011), as the family's own code would
    fail without it. A key under ``text_config`` counts as present (multimodal wrappers such as Kimi-K2.5/K3).
    ``names`` lists the published name first, then the aliases of the configuration class's ``attribute_map``
    (transformers writes some fields under the alias: Qwen3-MoE's ``num_experts`` as ``num_local_experts``).
    """

    names: tuple[str, ...]
    default: Any = None


@dataclass(frozen=True)
class RouterRule:
    """How the router turns ``logits = x @ gate^T (+ router bias)`` ``[T, E]`` into K expert ids and weights.

    Attributes:
        scoring: ``"softmax"`` (over all E), ``"sigmoid"``, ``"topk_softmax"`` (top-k over the logits, then a
            softmax over the K chosen logits: gpt-oss), or the ``Key`` naming it (DeepSeek's ``scoring_func``).
        topk_method: DeepSeek's ``topk_method`` (a ``Key`` or a constant): picks ``selection_bias`` and
            ``group_score`` from ``TOPK_METHODS``; None: the two attributes below hold.
        selection_bias: ``e_score_correction_bias [E]`` is added to the scores for the selection only (the weights
            stay unbiased): DeepSeek-V3 noaux_tc, Ernie-4.5's ``moe_statics``.
        group_score: grouped top-k: ``"top2_sum"`` (DeepSeek-V3), ``"max"`` (DeepSeek-V2 group_limited_greedy), or
            None (no group stage).
        num_groups, num_topk_groups: the group counts (``n_group``, ``topk_group``), read when groups apply.
        renormalize: divide the K weights by their sum (a constant or ``norm_topk_prob``-style key).
        routed_scaling_factor: the key of the factor multiplying the weights, or None (1.0).
        router_bias: the gate Linear has a bias ``[E]`` added to the logits (gpt-oss ``router.bias``).
    """

    scoring: str | Key
    topk_method: str | Key | None = None
    selection_bias: bool = False
    group_score: str | None = None
    num_groups: Key | None = None
    num_topk_groups: Key | None = None
    renormalize: bool | Key = False
    routed_scaling_factor: Key | None = None
    router_bias: bool = False


@dataclass(frozen=True)
class ExpertRule:
    """One routed expert: ``down(act(gate(x), up(x)))``.

    Attributes:
        intermediate_size: the key of F (``moe_intermediate_size``, or ``intermediate_size`` where the family has
            only one width: Mixtral, OLMoE, gpt-oss, HunYuan).
        activation: ``hidden_act``'s key, or a constant where the experts ignore it (gpt-oss: ``"swigluoai"``,
            ``(up + 1) * g * sigmoid(alpha * g)`` with g clamped above at ``limit`` and up to [-limit, limit]).
        bias: the experts' Linear layers have biases (gpt-oss ``gate_up_proj_bias [E, 2F]``,
            ``down_proj_bias [E, D]``).
        swiglu_alpha, swiglu_limit: keys of the clamped SwiGLU's alpha and limit (gpt-oss), or None.
        situ_beta, situ_linear_beta: keys of SiTU's betas (Kimi-K3), or None.
    """

    intermediate_size: Key
    activation: str | Key = Key(("hidden_act",), "silu")
    bias: bool = False
    swiglu_alpha: Key | None = None
    swiglu_limit: Key | None = None
    situ_beta: Key | None = None
    situ_linear_beta: Key | None = None


@dataclass(frozen=True)
class SharedRule:
    """The shared experts, run on every token and added to the routed sum.

    Attributes:
        count: number of shared experts (a constant or a key); None: one when ``size`` is positive.
        size: ``"per_expert"`` (S = count x the routed expert's F: DeepSeek, GLM, Ernie, Kimi) or the key of the
            whole shared MLP's width S (Qwen2-MoE ``shared_expert_intermediate_size``, Step3 ``share_expert_dim``,
            HunYuan ``intermediate_size``).
        gate: Qwen2-MoE's ``shared_expert_gate``: the shared output is scaled by ``sigmoid(x @ w)``, ``w [D]``.
    """

    count: int | Key | None = 0
    size: str | Key = "per_expert"
    gate: bool = False


@dataclass(frozen=True)
class MoELayers:
    """Which decoder layers hold the MoE block (the rest are dense MLPs), by the family's rule.

    Attributes:
        kind: ``"first_k_dense"`` (layers from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th),
            ``"sparse_step"`` (Qwen: ``(i + 1) % decoder_sparse_step == 0`` and i not in ``mlp_only_layers``),
            ``"interval"`` (Ernie: ``(i + 1) % moe_layer_interval == 0`` within ``[moe_layer_start_index,
            moe_layer_end_index]``, -1 = the last layer), ``"enum"`` (Step3: ``moe_layers_enum``, comma-separated)
            or ``"all"``.
        keys: the keys the rule reads, by role (``first_dense``, ``freq``, ``step``, ``dense_list``, ``start``,
            ``end``, ``interval``, ``enum``).
    """

    kind: str = "all"
    keys: tuple[tuple[str, Key], ...] = ()

    def key(self, role: str) -> Key:
        return dict(self.keys)[role]


@dataclass(frozen=True)
class LatentRule:
    """Kimi-K3's latent MoE: experts run on ``x @ latent_down^T`` ``[T, L]``; the routed sum goes through RMSNorm
    (if ``norm``) after the full cross-rank sum, then ``latent_up``.

    Attributes:
        enabled: the key saying the model uses it (``use_latent_moe``).
        dim: the key of L.
        norm: the key of the RMSNorm switch.
    """

    enabled: Key
    dim: Key
    norm: Key


@dataclass(frozen=True)
class TensorLayout:
    """The tensor names of one MoE layer in one published layout, relative to the decoder layer's prefix (e.g.
    ``model.layers.3.``); per-expert names hold ``{expert}``. None: the family has no such tensor.

    Attributes:
        name: ``"hub"`` (as published on the Hugging Face Hub, and as transformers' ``save_pretrained`` writes it)
            or ``"fused"`` (transformers 5.x's in-memory experts, ``mlp.experts.gate_up_proj``).
        module: the MoE block's module under the decoder layer (``"mlp"``, ``"block_sparse_moe"``, ``"moe"``); the
            names starting with it are its tensors (Step3's shared expert sits beside it, ``share_expert.``).
        router: the gate weight ``[E, D]``.
        router_bias: the gate's bias ``[E]`` (gpt-oss).
        selection_bias: ``e_score_correction_bias``, ``[E]`` or ``[1, E]`` (Ernie).
        experts: ``"per_expert"`` (``gate``/``up``/``down`` one tensor per expert), ``"stacked"`` (``gate``/``up``
            ``[E, F, Dx]``, ``down [E, Dx, F]``: Step3) or ``"stacked_gate_up"`` (``gate_up [E, 2F, Dx]``,
            ``down [E, Dx, F]``: transformers 5.x).
        gate, up, down, gate_up: the expert weights (nn.Linear's ``[out, in]`` unless ``transposed``).
        transposed: stored ``[E, in, out]`` for ``x @ W`` (gpt-oss: gate_up ``[E, D, 2F]``, down ``[E, F, D]``).
        interleaved: gate and up alternate along gate_up's output dim (gpt-oss: gate j at 2j, up j at 2j + 1), else
            gate rows then up rows.
        gate_up_bias, down_bias: the experts' biases ``[E, 2F]`` (same order as gate_up) and ``[E, D]``.
        shared_gate, shared_up, shared_down: the shared MLP (``[S, D]``, ``[S, D]``, ``[D, S]``).
        shared_expert_gate: Qwen2-MoE's shared-expert gate ``[1, D]``.
        latent_down, latent_up, latent_norm: Kimi-K3's ``[L, D]``, ``[D, L]``, ``[L]``.
    """

    name: str
    module: str
    router: str
    experts: str
    down: str
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None
    router_bias: str | None = None
    selection_bias: str | None = None
    transposed: bool = False
    interleaved: bool = False
    gate_up_bias: str | None = None
    down_bias: str | None = None
    shared_gate: str | None = None
    shared_up: str | None = None
    shared_down: str | None = None
    shared_expert_gate: str | None = None
    latent_down: str | None = None
    latent_up: str | None = None
    latent_norm: str | None = None


@dataclass(frozen=True)
class Family:
    """One model family: the model_types it covers, its config.json keys, its block's math and its tensor names.

    Attributes:
        name: the family's id (``MoEConfig.family``).
        model_types: the config.json ``model_type`` values it covers (a ``text_config``'s model_type wins).
        models: the published models it covers, for messages (``"DeepSeek-V3/R1, Kimi-K2/K2.5"``).
        hidden_size, num_experts, num_topk: keys of D, E and K.
        router, experts, shared: the block's math (``RouterRule``, ``ExpertRule``, ``SharedRule``).
        moe_layers: which decoder layers are MoE layers (``MoELayers``).
        layouts: the published tensor layouts, the Hub's first (``TensorLayout``).
        latent: Kimi-K3's latent MoE (``LatentRule``), or None.
        rms_norm_eps: key of the latent RMSNorm's epsilon.
        unsupported: ``(key, value it must have, what else it would mean)``: config values that turn on a feature
            of the family moe_ref does not compute (refused with CFG025, never ignored).
    """

    name: str
    model_types: tuple[str, ...]
    models: str
    num_experts: Key
    num_topk: Key
    router: RouterRule
    experts: ExpertRule
    layouts: tuple[TensorLayout, ...]
    shared: SharedRule = SharedRule()
    moe_layers: MoELayers = MoELayers()
    hidden_size: Key = Key(("hidden_size",))
    latent: LatentRule | None = None
    rms_norm_eps: Key = Key(("rms_norm_eps",), 1e-6)
    unsupported: tuple[tuple[str, Any, str], ...] = ()

    def layout(self, name: str) -> TensorLayout | None:
        """The layout called ``name`` (``"hub"``, ``"fused"``), or None when the family has no such layout."""
        return next((layout for layout in self.layouts if layout.name == name), None)

    @property
    def layout_names(self) -> tuple[str, ...]:
        return tuple(layout.name for layout in self.layouts)
