"""Model and parallel configuration: what the MoE block computes and how it is spread over ranks.

``MoEConfig`` holds the routed-expert block of one model family (any family registered in
``moe_ref.core.families``, or a custom one); ``MoEConfig.from_hf_config`` reads a config.json (path, folder, dict
or a transformers ``PretrainedConfig``) with its family's field names, defaults and rules.
``ParallelConfig`` holds tp/ep/dp sizes. Both are frozen and checked on construction; ``problems()``
lists every problem at once (used by ``moe-ref check``).

Presets: ``preset("kimi-k2")`` (real sizes, from the JSON copies in ``moe_ref/core/presets/``) and
``preset("tiny-kimi-k2")`` (same semantics, tiny sizes, for tests and demos).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from moe_ref.core.errors import (
    ConfigError,
    ConfigFieldError,
    ConfigFileError,
    ExpertsNotDivisibleError,
    GroupConfigError,
    InvalidConfigError,
    TopKError,
    TPExceedsExpertsError,
    UnknownFamilyError,
    UnknownNameError,
    UnsupportedFamilyFeatureError,
)
from moe_ref.core.families import (FAMILIES, TOPK_METHODS, Family, Key, family_for_model_type, family_named,
                                   supported_model_types)

SCORING_FUNCS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORES = ("top2_sum", "max")
ACTIVATIONS = ("silu", "situ", "swigluoai")
_PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class MoEConfig:
    """The routed-expert block of one model (one MoE layer; every MoE layer of a model shares it).

    Router (``moe_ref.core.router``): ``logits = x @ gate^T`` (+ a router bias when ``router_bias``);
    ``scores = softmax|sigmoid(logits)``, or the logits themselves for ``topk_softmax``; selection adds
    ``e_score_correction_bias`` when ``use_selection_bias``; grouped top-k keeps ``num_topk_groups`` of
    ``num_groups`` groups, each scored by ``group_score`` (``top2_sum``: DeepSeek-V3; ``max``: DeepSeek-V2's
    group_limited_greedy); the weights are the unbiased scores of the chosen experts (``topk_softmax``: a softmax
    over the K chosen logits, gpt-oss), renormalised if ``renormalize``, times ``routed_scaling_factor``.
    Experts: ``down(act(gate(x), up(x)))`` with ``activation`` SiLU-gated, SiTU, or gpt-oss's clamped SwiGLU
    (``swigluoai`` with ``swiglu_alpha``, ``swiglu_limit``); ``expert_bias``: the experts' Linear layers have
    biases. Shared experts: one MLP of width ``shared_intermediate_size``, scaled by ``sigmoid(x @ w)`` when
    ``shared_expert_gate`` (Qwen2-MoE). Kimi-K3 (``latent_dim`` set): experts run on ``latent_down(x)`` and the
    routed sum goes through RMSNorm (if ``latent_norm``) and ``latent_up`` after the full cross-rank sum.
    ``family``: the registered family (``moe_ref.core.families``) the config was read as, or ``custom``.
    """

    num_experts: int
    num_topk: int
    hidden_size: int
    intermediate_size: int  # of one routed expert
    scoring: str = "sigmoid"
    use_selection_bias: bool = True
    renormalize: bool = True
    num_groups: int = 1
    num_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    activation: str = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # of the whole shared MLP (all shared experts fused)
    latent_dim: int | None = None
    latent_norm: bool = True
    rms_norm_eps: float = 1e-6
    family: str = "custom"  # a moe_ref.core.families name (deepseek_v3, qwen3_moe, ...) or custom
    name: str = "custom"
    moe_layers: tuple[int, ...] = field(default=(), compare=False)
    group_score: str = "top2_sum"
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_gate: bool = False
    num_layers: int | None = field(default=None, compare=False)  # decoder layers (num_hidden_layers), if known

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise problems[0]

    @classmethod
    def unchecked(cls, **fields_) -> "MoEConfig":
        """Build without validation, so ``moe-ref check`` can list every problem of a bad config."""
        obj = object.__new__(cls)
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        for key, value in {**defaults, **fields_}.items():
            object.__setattr__(obj, key, value)
        return obj

    # --- derived sizes ---------------------------------------------------------------------------------
    @property
    def expert_hidden_size(self) -> int:
        """Width the routed experts see: ``latent_dim`` for a latent MoE (Kimi-K3), else ``hidden_size``."""
        return self.latent_dim or self.hidden_size

    @property
    def has_shared_experts(self) -> bool:
        return self.num_shared_experts > 0 and self.shared_intermediate_size > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return not self.moe_layers or layer_idx in self.moe_layers

    def problems(self) -> list[ConfigError]:
        """Every problem of this config (empty when valid), most basic first."""
        out: list[ConfigError] = []
        for name in ("num_experts", "num_topk", "hidden_size", "intermediate_size", "num_groups", "num_topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                out.append(InvalidConfigError(f"{name}={value!r} must be a positive integer", field=name))
        if out:
            return out
        if self.scoring not in SCORING_FUNCS:
            out.append(UnknownNameError(f"scoring={self.scoring!r}; supported: {', '.join(SCORING_FUNCS)}"))
        if self.activation not in ACTIVATIONS:
            out.append(UnknownNameError(f"activation={self.activation!r}; supported: {', '.join(ACTIVATIONS)}"))
        if self.group_score not in GROUP_SCORES:
            out.append(UnknownNameError(f"group_score={self.group_score!r}; supported: {', '.join(GROUP_SCORES)}"))
        if self.num_topk > self.num_experts:
            out.append(TopKError(f"num_topk={self.num_topk} > num_experts={self.num_experts}: each token picks "
                                 f"num_topk distinct experts; lower num_topk to at most {self.num_experts}"))
        out += self._group_problems()
        if self.latent_dim is not None and self.latent_dim <= 0:
            out.append(InvalidConfigError(f"latent_dim={self.latent_dim} must be positive or None"))
        if self.num_shared_experts < 0 or self.shared_intermediate_size < 0:
            out.append(InvalidConfigError(f"{self.num_shared_experts=} and {self.shared_intermediate_size=} must be >= 0"))
        if self.shared_expert_gate and not self.has_shared_experts:
            out.append(InvalidConfigError(
                f"shared_expert_gate=True gates the shared experts, but there are none ({self.num_shared_experts=}, "
                f"{self.shared_intermediate_size=}): set both, or shared_expert_gate=False", field="shared_expert_gate"))
        return out

    def _group_problems(self) -> list[ConfigError]:
        E, G, kept, k = self.num_experts, self.num_groups, self.num_topk_groups, self.num_topk
        if G == 1 and kept == 1:
            return []
        if E % G != 0:
            return [GroupConfigError(f"num_groups={G} does not divide num_experts={E}; pick a divisor of {E}")]
        out = []
        if kept > G:
            out.append(GroupConfigError(f"num_topk_groups={kept} > num_groups={G}; keep at most {G} groups"))
        elif kept * (E // G) < k:
            out.append(GroupConfigError(
                f"the {kept} kept groups hold {kept * (E // G)} experts, fewer than num_topk={k}; "
                f"raise num_topk_groups to at least {-(-k // (E // G))}"))
        if self.scoring == "softmax" and self.group_score == "top2_sum" and G > 1 and E // G < 2:
            out.append(GroupConfigError(f"groups of {E // G} expert cannot be scored by their top-2"))
        return out

    # --- HF config ------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: "str | os.PathLike | Mapping[str, Any] | Any", *,
                       validate: bool = True) -> "MoEConfig":
        """Read a model's config (config.json path, the folder holding it, its dict, or a transformers
        ``PretrainedConfig`` such as ``model.config``) with its family's field names, defaults and rules.

        The family is the one registered for the config's ``model_type`` (``moe_ref.core.families``; a
        ``text_config``'s wins): e.g. DeepSeek-V3/Kimi-K2 ``n_routed_experts``, ``num_experts_per_tok``, ``n_group``,
        ``topk_group``, ``scoring_func``, ``topk_method``, ``norm_topk_prob``, ``routed_scaling_factor``,
        ``n_shared_experts``; Qwen3-MoE ``num_experts``, ``norm_topk_prob``, ``decoder_sparse_step``; Mixtral
        ``num_local_experts``; gpt-oss ``swiglu_alpha``, ``swiglu_limit``; Ernie-4.5 ``moe_num_experts``, ``moe_k``.
        A field the config.json leaves out takes the family's default (its configuration class's).

        Raises:
            ConfigFileError (CFG010), ConfigFieldError (CFG011), UnknownFamilyError (CFG018),
            UnsupportedFamilyFeatureError (CFG025); with ``validate``, the first of ``problems()``.
        """
        raw = read_hf_config_json(path_or_dict)
        kwargs = hf_config_to_fields(raw, source=_source(path_or_dict))
        return cls(**kwargs) if validate else cls.unchecked(**kwargs)


def _source(path_or_dict) -> str:
    """The config's file for messages (``<dict>`` for a dict, ``<ClassName>`` for a config object)."""
    if isinstance(path_or_dict, (str, os.PathLike)):
        path = Path(path_or_dict)
        return str(path / "config.json" if path.is_dir() else path)
    return "<dict>" if isinstance(path_or_dict, Mapping) else f"<{type(path_or_dict).__name__}>"


def is_hf_config_object(obj) -> bool:
    """Whether ``obj`` is a transformers ``PretrainedConfig`` (duck-typed: core does not import transformers): its
    ``to_dict()`` holds the config.json's fields and ``MoEConfig.from_hf_config`` reads it."""
    return callable(getattr(obj, "to_dict", None)) and isinstance(getattr(obj, "model_type", None), str)


def read_hf_config_json(path_or_dict: "str | os.PathLike | Mapping[str, Any] | Any") -> dict:
    """The config dict of a config.json path, the folder holding it, a dict, or a transformers ``PretrainedConfig``
    (its ``to_dict()``, which is what ``save_pretrained`` writes).

    Raises ``ConfigFileError`` (CFG010) naming the file: None or another type given, a missing file,
    a file that is not JSON, or JSON that is not an object.
    """
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if is_hf_config_object(path_or_dict):
        return dict(path_or_dict.to_dict())
    if not isinstance(path_or_dict, (str, os.PathLike)):
        shown = repr(path_or_dict)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ConfigFileError(
            f"the model config is {shown} ({type(path_or_dict).__name__}); pass a MoEConfig, a preset name, the path "
            f"of config.json (or its folder), its dict, or a transformers PretrainedConfig (model.config), e.g. "
            f"MoEConfig.from_hf_config('<model dir>')")
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigFileError(f"config file {str(path)!r} does not exist; pass the config.json that came with the "
                              f"checkpoint (or its folder)", path=str(path))
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigFileError(f"config file {str(path)!r} is not valid JSON ({err}); restore it from the model's "
                              f"published config.json", path=str(path)) from None
    if not isinstance(raw, dict):
        raise ConfigFileError(f"config file {str(path)!r} holds a JSON {type(raw).__name__}, not an object "
                              f"({{\"hidden_size\": ..., ...}}); restore it from the model's published config.json",
                              path=str(path))
    return raw


class _Fields:
    """Typed reads of an HF config dict; every bad value raises ``ConfigFieldError`` (CFG011) naming the file,
    the key, what was found and the fix."""

    def __init__(self, d: Mapping[str, Any], source: str):
        self.d, self.source = d, source

    def _raw(self, names: tuple[str, ...]):
        """(key, value) of the first of ``names`` present with a non-null value, else (None, None)."""
        for name in names:
            if self.d.get(name) is not None:
                return name, self.d[name]
        return None, None

    def bad(self, key: str, value, want: str) -> ConfigFieldError:
        """CFG011 (not raised): ``key`` holds ``value``, which is not ``want``."""
        return ConfigFieldError(f"{self.source}: {key!r} is {json.dumps(value)} ({type(value).__name__}); it must be "
                                f"{want}: fix it in the file (e.g. from the model's published config.json)",
                                field=key, path=self.source)

    def read(self, key: Key, kind: type, what: str | None = None):
        """The value of ``key`` (a family's ``Key``) as ``kind`` (int, float, bool or str); its default when absent,
        CFG011 when absent and required (default None) or mistyped."""
        if kind is int:
            return self.required_int(*key.names, what=what or key.names[0]) if key.default is None \
                else self.optional_int(*key.names, default=key.default)
        if key.default is None and self._raw(key.names)[0] is None:
            raise self._missing(key.names, what or key.names[0], {float: "a JSON number", bool: "true or false",
                                                                   str: "a JSON string"}[kind])
        reader = {float: self.number, bool: self.boolean, str: self.string}[kind]
        return reader(*key.names, default=key.default)

    def _missing(self, names: tuple[str, ...], what: str, want: str) -> ConfigFieldError:
        null = [name for name in names if name in self.d]
        found = (f"{null[0]!r} is null" if null else f"{names[0]!r} is missing" if len(names) == 1
                 else f"none of {', '.join(repr(n) for n in names)} is present")
        return ConfigFieldError(f"{self.source}: {found}; the config needs {what} as {want} (\"{names[0]}\": the "
                                f"model's value, from its published config.json): fix it in the file",
                                field=names[0], path=self.source)

    def required_int(self, *names: str, what: str) -> int:
        key, value = self._raw(names)
        if key is None:
            raise self._missing(names, what, "a JSON integer")
        return self._int(key, value)

    def optional_int(self, *names: str, default: int | None = None) -> int | None:
        key, value = self._raw(names)
        return default if key is None else self._int(key, value)

    def _int(self, key: str, value) -> int:
        # per-layer lists (HunYuan's moe_topk, num_experts) are one value when every layer has the same
        if isinstance(value, list) and value and len(set(map(repr, value))) == 1:
            value = value[0]
        elif isinstance(value, list) and value:
            raise self.bad(key, value, "one integer for every layer (moe_ref builds one block shape for a model; "
                                       "these per-layer values differ)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(key, value, "a JSON integer (write 7168, not \"7168\" or 7168.5)")
        return value

    def int_list(self, key: Key) -> tuple[int, ...]:
        """A list of integers (Qwen's ``mlp_only_layers``); the key's default when absent."""
        name, value = self._raw(key.names)
        if name is None:
            return tuple(key.default)
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self.bad(name, value, "a JSON list of layer numbers ([0, 1])")
        return tuple(value)

    def number(self, *names: str, default: float) -> float:
        key, value = self._raw(names)
        if key is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.bad(key, value, "a JSON number")
        return float(value)

    def boolean(self, *names: str, default: bool) -> bool:
        return self._typed(names, default, bool, "true or false")

    def string(self, *names: str, default: str | None) -> str | None:
        return self._typed(names, default, str, "a JSON string")

    def _typed(self, names: tuple[str, ...], default, kind: type, want: str):
        key, value = self._raw(names)
        if key is None:
            return default
        if not isinstance(value, kind):
            raise self.bad(key, value, want)
        return value


def hf_config_to_fields(raw: Mapping[str, Any], source: str = "<dict>") -> dict[str, Any]:
    """Map an HF config dict of a registered family (``moe_ref.core.families``) to ``MoEConfig`` keyword arguments.

    Args:
        raw: the parsed config.json (a ``text_config`` is merged over it: multimodal wrappers).
        source: where it came from, for messages.

    Raises:
        UnknownFamilyError (CFG018) for a model_type no family covers; ConfigFieldError (CFG011) for a missing,
        null or mistyped field; UnsupportedFamilyFeatureError (CFG025) for a value that turns on a feature of the
        family moe_ref does not compute (e.g. DeepSeek-V2 ``mlp_bias: true``, an unknown ``topk_method``).
    """
    text_config = raw.get("text_config")
    d = {**raw, **text_config} if isinstance(text_config, Mapping) else dict(raw)
    f = _Fields(d, source)
    model_type = f.string("model_type", default="")
    family = _family(model_type, d, source)
    _refuse_unsupported(family, d, source)
    router, experts = _router_fields(f, family, source), _expert_fields(f, family)
    latent = family.latent
    latent_dim = f.read(latent.dim, int) if latent is not None and f.read(latent.enabled, bool) else None
    return dict(
        num_experts=f.read(family.num_experts, int, "the routed-expert count"),
        num_topk=f.read(family.num_topk, int, "the experts per token (top-k)"),
        hidden_size=f.read(family.hidden_size, int, "the hidden size"),
        **router, **experts, **_shared_fields(f, family, experts["intermediate_size"]),
        latent_dim=latent_dim or None,
        latent_norm=f.read(latent.norm, bool) if latent is not None else True,
        rms_norm_eps=f.read(family.rms_norm_eps, float),
        family=family.name,
        name=str(raw.get("_name", model_type)),
        moe_layers=_moe_layers(f, family),
        num_layers=f.optional_int("num_hidden_layers"),
    )


def _family(model_type: str, d: Mapping[str, Any], source: str) -> Family:
    """The registered family of ``model_type``; UnknownFamilyError (CFG018) for any other (no guessing from field
    names: families share field names but not their router, shared experts or tensor names). ``custom`` is for
    MoEConfig(...) built in code only."""
    family = family_for_model_type(model_type)
    if family is not None:
        return family
    what = f"model_type {model_type!r}" if model_type else "no model_type"
    expert_keys = sorted({n for fam in FAMILIES for n in fam.num_experts.names})
    dense = "" if any(d.get(k) is not None for k in expert_keys) else (
        f" It has none of the families' routed-expert counts ({', '.join(expert_keys)}): is it an MoE model?")
    raise UnknownFamilyError(
        f"{source}: {what}: moe_ref does not know this model family's routing rule and tensor names, and will not "
        f"guess them from field names.{dense} Supported model_types: {', '.join(supported_model_types())}. To add "
        f"a family, write moe_ref/core/families/<family>.py (one Family record: its config keys, router, experts, "
        f"shared experts and tensor names, read from its modeling code) and list it in "
        f"moe_ref.core.families.FAMILIES; for a block of your own, build MoEConfig(...) in code (family 'custom')",
        field="model_type", model_type=model_type)


def _refuse_unsupported(family: Family, d: Mapping[str, Any], source: str) -> None:
    """UnsupportedFamilyFeatureError (CFG025) for a config value that turns on a feature moe_ref does not compute."""
    for key, wanted, feature in family.unsupported:
        if d.get(key) is not None and d[key] != wanted:
            raise UnsupportedFamilyFeatureError(
                f"{source}: {key!r} is {json.dumps(d[key])}: {family.models} ({family.name}) with {feature}; moe_ref "
                f"computes this family with {key}={json.dumps(wanted)} only, so it refuses rather than drop them",
                field=key, family=family.name)


def _router_fields(f: _Fields, family: Family, source: str) -> dict[str, Any]:
    rule = family.router
    scoring = rule.scoring if isinstance(rule.scoring, str) else f.read(rule.scoring, str)
    selection_bias, group_score = rule.selection_bias, rule.group_score
    if rule.topk_method is not None:
        method = rule.topk_method if isinstance(rule.topk_method, str) else f.read(rule.topk_method, str)
        if method not in TOPK_METHODS:
            raise UnsupportedFamilyFeatureError(
                f"{source}: 'topk_method' is {json.dumps(method)}; {family.models} ({family.name}) routes with "
                f"{', '.join(TOPK_METHODS)}: fix it from the model's published config.json",
                field="topk_method", family=family.name)
        selection_bias, group_score = TOPK_METHODS[method]
    grouped = group_score is not None and rule.num_groups is not None
    renorm = rule.renormalize if isinstance(rule.renormalize, bool) else f.read(rule.renormalize, bool)
    scale = f.read(rule.routed_scaling_factor, float) if rule.routed_scaling_factor is not None else 1.0
    return dict(scoring=scoring, use_selection_bias=selection_bias, group_score=group_score or "top2_sum",
                num_groups=f.read(rule.num_groups, int) if grouped else 1,
                num_topk_groups=f.read(rule.num_topk_groups, int) if grouped else 1,
                renormalize=renorm, routed_scaling_factor=scale, router_bias=rule.router_bias)


def _expert_fields(f: _Fields, family: Family) -> dict[str, Any]:
    rule, defaults = family.experts, {fl.name: fl.default for fl in dataclasses.fields(MoEConfig)}
    activation = rule.activation if isinstance(rule.activation, str) else f.read(rule.activation, str)
    optional = {name: f.read(key, float) if key is not None else defaults[name]
                for name, key in (("swiglu_alpha", rule.swiglu_alpha), ("swiglu_limit", rule.swiglu_limit),
                                  ("situ_beta", rule.situ_beta), ("situ_linear_beta", rule.situ_linear_beta))}
    return dict(intermediate_size=f.read(rule.intermediate_size, int, "the routed expert's intermediate size"),
                activation=activation.lower(), expert_bias=rule.bias, **optional)


def _shared_fields(f: _Fields, family: Family, intermediate_size: int) -> dict[str, Any]:
    rule = family.shared
    size = None if rule.size == "per_expert" else f.read(rule.size, int)
    count = rule.count if isinstance(rule.count, int) else f.read(rule.count, int) if rule.count is not None \
        else int(bool(size))
    width = 0 if not count else count * intermediate_size if size is None else size
    return dict(num_shared_experts=count if width else 0, shared_intermediate_size=width,
                shared_expert_gate=rule.gate and bool(width))


def _moe_layers(f: _Fields, family: Family) -> tuple[int, ...]:
    """The MoE layers by the family's rule (``MoELayers``); () when the config does not say how many layers."""
    rule = family.moe_layers
    if rule.kind == "enum":
        enum = f.read(rule.key("enum"), str)
        try:
            return tuple(int(i) for i in enum.split(",") if i.strip())
        except ValueError:
            raise f.bad(rule.key("enum").names[0], enum, "comma-separated layer numbers (\"4,5,6\")") from None
    num_layers = f.optional_int("num_hidden_layers")
    if num_layers is None:
        return ()
    if rule.kind == "first_k_dense":
        first, freq = f.read(rule.key("first_dense"), int), f.read(rule.key("freq"), int)
        if freq < 1:
            raise f.bad(rule.key("freq").names[0], freq, "a positive integer")
        return tuple(i for i in range(first, num_layers) if (i - first) % freq == 0)
    if rule.kind == "sparse_step":
        step, dense = f.read(rule.key("step"), int), f.int_list(rule.key("dense_list"))
        if step < 1:
            raise f.bad(rule.key("step").names[0], step, "a positive integer")
        return tuple(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense)
    if rule.kind == "interval":
        start, end = f.read(rule.key("start"), int), f.read(rule.key("end"), int)
        interval = f.read(rule.key("interval"), int)
        if interval < 1:
            raise f.bad(rule.key("interval").names[0], interval, "a positive integer")
        end = num_layers - 1 if end == -1 else end
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end)
    return tuple(range(num_layers))


@dataclass(frozen=True)
class ParallelConfig:
    """How one MoE layer is spread: ``ep_size`` ranks own disjoint expert blocks; ``tp_size`` and
    ``dp_size`` describe the rest of the deployment (attention TP / data parallel) for ``moe-ref check``
    and ``moe-ref plan``. ``attention_dp``: each DP rank feeds its own tokens to the MoE (the per-rank cap
    counts one rank's rows, never dp_size x ep_size of them)."""

    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    attention_dp: bool = False

    def __post_init__(self):
        for name in ("tp_size", "ep_size", "dp_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise InvalidConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")

    def problems(self, cfg: MoEConfig) -> list[ConfigError]:
        """Problems of running ``cfg`` with these sizes (empty when fine)."""
        out: list[ConfigError] = []
        if self.tp_size > cfg.num_experts:
            out.append(TPExceedsExpertsError(
                f"tp_size={self.tp_size} > num_experts={cfg.num_experts}: the MoE weights cannot be split over "
                f"{self.tp_size} TP ranks; use tp_size <= {cfg.num_experts} and spread the rest with "
                f"ep_size/dp_size (e.g. --tp {_largest_divisor_at_most(self.tp_size, cfg.num_experts)} "
                f"--dp {self.tp_size // _largest_divisor_at_most(self.tp_size, cfg.num_experts)})",
                tp_size=self.tp_size, num_experts=cfg.num_experts))
        if cfg.num_experts % self.ep_size != 0:
            divisors = [d for d in range(1, min(cfg.num_experts, 64) + 1) if cfg.num_experts % d == 0]
            out.append(ExpertsNotDivisibleError(
                f"num_experts={cfg.num_experts} % ep_size={self.ep_size} = {cfg.num_experts % self.ep_size}: "
                f"experts are placed in equal blocks; choose ep_size in {divisors}",
                num_experts=cfg.num_experts, ep_size=self.ep_size))
        return out

    def num_local_experts(self, cfg: MoEConfig) -> int:
        problems = self.problems(cfg)
        if problems:
            raise problems[0]
        return cfg.num_experts // self.ep_size


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)


# --- presets -------------------------------------------------------------------------------------------

REAL_PRESETS = ("deepseek-v3", "kimi-k2", "kimi-k3", "step3")

# Tiny variants keep each family's semantics (router, groups, latent, activation) at test sizes.
# Odd sizes on purpose: hidden 48 and intermediate 40 are not powers of two.
_TINY_OVERRIDES = {
    "deepseek-v3": dict(num_experts=16, num_topk=4, hidden_size=48, intermediate_size=40,
                        num_groups=4, num_topk_groups=2, shared_intermediate_size=40),
    "kimi-k2": dict(num_experts=16, num_topk=4, hidden_size=48, intermediate_size=40, shared_intermediate_size=40),
    "kimi-k3": dict(num_experts=16, num_topk=4, hidden_size=48, intermediate_size=24, latent_dim=32,
                    shared_intermediate_size=48),
    "step3": dict(num_experts=8, num_topk=3, hidden_size=48, intermediate_size=40, shared_intermediate_size=40),
}
PRESETS = REAL_PRESETS + tuple(f"tiny-{name}" for name in REAL_PRESETS)


def preset(name: str) -> MoEConfig:
    """A preset config: one of ``PRESETS`` (``kimi-k2``, ``tiny-kimi-k2``, ...)."""
    base = name[len("tiny-"):] if name.startswith("tiny-") else name
    if base not in REAL_PRESETS:
        raise UnknownNameError(f"preset={name!r}; available: {', '.join(PRESETS)}")
    cfg = MoEConfig.from_hf_config({**json.loads((_PRESET_DIR / f"{base}.json").read_text()), "_name": base})
    if name.startswith("tiny-"):
        cfg = dataclasses.replace(cfg, name=name, moe_layers=(), num_layers=None, **_TINY_OVERRIDES[base])
    return cfg


def hf_config_dict(cfg: MoEConfig) -> dict[str, Any]:
    """An HF config dict of ``cfg``'s family (inverse of ``from_hf_config``; used to write synthetic checkpoints
    next to their config.json). ``custom`` is written as DeepSeek-V3; one decoder layer, an MoE layer."""
    family = family_named(cfg.family)
    if family is not None and family.name not in ("step3", "kimi_k3", "deepseek_v3", "kimi_k2"):
        return _family_config_dict(cfg, family)
    if cfg.family == "step3":
        return {"model_type": "step3_text", "hidden_size": cfg.hidden_size, "moe_num_experts": cfg.num_experts,
                "moe_top_k": cfg.num_topk, "moe_intermediate_size": cfg.intermediate_size,
                "norm_expert_weight": cfg.renormalize, "share_expert_dim": cfg.shared_intermediate_size,
                "hidden_act": cfg.activation, "num_hidden_layers": 1, "moe_layers_enum": "0"}
    if cfg.family == "kimi_k3":
        return {"model_type": "kimi_k3", "text_config": {
            "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_topk,
            "moe_intermediate_size": cfg.intermediate_size, "num_shared_experts": cfg.num_shared_experts,
            "num_expert_group": cfg.num_groups, "topk_group": cfg.num_topk_groups,
            "moe_router_activation_func": cfg.scoring, "moe_renormalize": cfg.renormalize,
            "routed_scaling_factor": cfg.routed_scaling_factor, "use_latent_moe": cfg.latent_dim is not None,
            "latent_moe_dim": cfg.latent_dim, "latent_moe_use_norm": cfg.latent_norm,
            "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.activation,
            "activation_situ_beta": cfg.situ_beta, "activation_situ_linear_beta": cfg.situ_linear_beta,
            "num_hidden_layers": 1, "first_k_dense_replace": 0}}
    return {"model_type": "kimi_k2" if cfg.family == "kimi_k2" else "deepseek_v3",
            "hidden_size": cfg.hidden_size, "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_topk, "moe_intermediate_size": cfg.intermediate_size,
            "n_shared_experts": cfg.num_shared_experts, "n_group": cfg.num_groups, "topk_group": cfg.num_topk_groups,
            "topk_method": "noaux_tc" if cfg.use_selection_bias else "greedy", "scoring_func": cfg.scoring,
            "norm_topk_prob": cfg.renormalize, "routed_scaling_factor": cfg.routed_scaling_factor,
            "hidden_act": cfg.activation, "num_hidden_layers": 1, "first_k_dense_replace": 0,
            "rms_norm_eps": cfg.rms_norm_eps}


def _family_config_dict(cfg: MoEConfig, family: Family) -> dict[str, Any]:
    """``cfg`` under ``family``'s config.json keys (each fact written under its first key name)."""
    router, experts, shared = family.router, family.experts, family.shared
    out: dict[str, Any] = {"model_type": family.model_types[0], "num_hidden_layers": 1,
                           "rms_norm_eps": cfg.rms_norm_eps}
    facts = [(family.hidden_size, cfg.hidden_size), (family.num_experts, cfg.num_experts),
             (family.num_topk, cfg.num_topk), (experts.intermediate_size, cfg.intermediate_size),
             (router.scoring, cfg.scoring), (router.renormalize, cfg.renormalize),
             (router.routed_scaling_factor, cfg.routed_scaling_factor), (router.num_groups, cfg.num_groups),
             (router.num_topk_groups, cfg.num_topk_groups), (experts.activation, cfg.activation),
             (experts.swiglu_alpha, cfg.swiglu_alpha), (experts.swiglu_limit, cfg.swiglu_limit),
             (experts.situ_beta, cfg.situ_beta), (experts.situ_linear_beta, cfg.situ_linear_beta)]
    if isinstance(router.topk_method, Key):
        grouping = None if cfg.num_groups == 1 and not cfg.use_selection_bias else cfg.group_score
        method = next(m for m, rule in TOPK_METHODS.items() if rule == (cfg.use_selection_bias, grouping))
        facts.append((router.topk_method, method))
    if isinstance(shared.count, Key):
        per_expert = cfg.shared_intermediate_size // max(cfg.intermediate_size, 1)
        facts.append((shared.count, cfg.num_shared_experts if shared.size == "per_expert" else per_expert))
    if isinstance(shared.size, Key):
        facts.append((shared.size, cfg.shared_intermediate_size))
    for key, value in facts:
        if isinstance(key, Key):
            out.setdefault(key.names[0], value)
    # the MoE-layer rule's keys set so that the one layer is an MoE layer
    first_layer = {"first_dense": 0, "freq": 1, "step": 1, "dense_list": [], "start": 0, "end": -1, "interval": 1,
                   "enum": "0"}
    for role, key in family.moe_layers.keys:
        out[key.names[0]] = first_layer[role]
    return out
