"""Model and parallel configuration: what the MoE block computes and how it is spread over ranks.

``MoEConfig`` holds the routed-expert block of one model family (Kimi-K2/K3, DeepSeek-V3, Step3 or a
custom one); ``MoEConfig.from_hf_config`` reads each family's real ``config.json`` field names.
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
)

SCORING_FUNCS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "situ")
_PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class MoEConfig:
    """The routed-expert block of one model (one MoE layer; every MoE layer of a model shares it).

    Router: ``scores = softmax|sigmoid(logits)``; selection adds ``e_score_correction_bias`` when
    ``use_selection_bias``; grouped top-k keeps ``num_topk_groups`` of ``num_groups`` groups; the weights
    are the unbiased scores of the chosen experts, renormalised if ``renormalize``, times
    ``routed_scaling_factor``. Experts: ``down(act(gate(x), up(x)))`` with ``activation`` SiLU-gated or
    SiTU. Kimi-K3 (``latent_dim`` set): experts run on ``latent_down(x)`` and the routed sum goes through
    RMSNorm (if ``latent_norm``) and ``latent_up`` after the full cross-rank sum.
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
    family: str = "custom"  # deepseek_v3 | kimi_k2 | kimi_k3 | step3 | custom
    name: str = "custom"
    moe_layers: tuple[int, ...] = field(default=(), compare=False)

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
        if self.num_topk > self.num_experts:
            out.append(TopKError(f"num_topk={self.num_topk} > num_experts={self.num_experts}: each token picks "
                                 f"num_topk distinct experts; lower num_topk to at most {self.num_experts}"))
        out += self._group_problems()
        if self.latent_dim is not None and self.latent_dim <= 0:
            out.append(InvalidConfigError(f"latent_dim={self.latent_dim} must be positive or None"))
        if self.num_shared_experts < 0 or self.shared_intermediate_size < 0:
            out.append(InvalidConfigError(f"{self.num_shared_experts=} and {self.shared_intermediate_size=} must be >= 0"))
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
        if self.scoring == "softmax" and G > 1 and E // G < 2:
            out.append(GroupConfigError(f"groups of {E // G} expert cannot be scored by their top-2"))
        return out

    # --- HF config ------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], *, validate: bool = True) -> "MoEConfig":
        """Read a model's ``config.json`` (path, folder holding it, or dict) with its family's field names.

        Kimi-K2/DeepSeek-V3: ``n_routed_experts``, ``num_experts_per_tok``, ``n_group``, ``topk_group``,
        ``scoring_func``, ``topk_method``, ``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts``.
        Kimi-K3: ``text_config`` with ``num_experts``, ``num_experts_per_token``, ``num_expert_group``,
        ``moe_router_activation_func``, ``moe_renormalize``, ``num_shared_experts``, ``use_latent_moe``,
        ``latent_moe_dim``, ``hidden_act: situ``. Step3: ``moe_num_experts``, ``moe_top_k``,
        ``norm_expert_weight``, ``share_expert_dim``, ``moe_layers_enum`` (softmax router).
        """
        raw = read_hf_config_json(path_or_dict)
        kwargs = hf_config_to_fields(raw, source=_source(path_or_dict))
        return cls(**kwargs) if validate else cls.unchecked(**kwargs)


def _source(path_or_dict) -> str:
    """The config's file for messages (``<dict>`` for a dict)."""
    if isinstance(path_or_dict, (str, os.PathLike)):
        path = Path(path_or_dict)
        return str(path / "config.json" if path.is_dir() else path)
    return "<dict>"


def read_hf_config_json(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict:
    """The config dict of a config.json path, the folder holding it, or a dict.

    Raises ``ConfigFileError`` (CFG010) naming the file: None or another type given, a missing file,
    a file that is not JSON, or JSON that is not an object.
    """
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigFileError(
            f"the model config is {path_or_dict!r} ({type(path_or_dict).__name__}); pass a MoEConfig, a preset name, "
            f"the path of config.json (or its folder) or its dict, e.g. MoEConfig.from_hf_config('<model dir>')")
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

    def _bad(self, key: str, value, want: str) -> ConfigFieldError:
        return ConfigFieldError(f"{self.source}: {key!r} is {json.dumps(value)} ({type(value).__name__}); it must be "
                                f"{want}: fix it in the file (e.g. from the model's published config.json)",
                                field=key, path=self.source)

    def required_int(self, *names: str, what: str) -> int:
        key, value = self._raw(names)
        if key is None:
            null = [name for name in names if name in self.d]
            found = (f"{null[0]!r} is null" if null else f"{names[0]!r} is missing" if len(names) == 1
                     else f"none of {', '.join(repr(n) for n in names)} is present")
            raise ConfigFieldError(f"{self.source}: {found}; the config needs {what} as a JSON integer (e.g. "
                                   f"\"{names[0]}\": 7168): fix it in the file", field=names[0], path=self.source)
        return self._int(key, value)

    def optional_int(self, *names: str, default: int | None = None) -> int | None:
        key, value = self._raw(names)
        return default if key is None else self._int(key, value)

    def _int(self, key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, value, "a JSON integer (write 7168, not \"7168\" or 7168.5)")
        return value

    def number(self, *names: str, default: float) -> float:
        key, value = self._raw(names)
        if key is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, value, "a JSON number")
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
            raise self._bad(key, value, want)
        return value


def hf_config_to_fields(raw: Mapping[str, Any], source: str = "<dict>") -> dict[str, Any]:
    """Map an HF config dict (any supported family) to ``MoEConfig`` keyword arguments.

    Args:
        raw: the parsed config.json.
        source: where it came from, for messages.

    Raises:
        ConfigFieldError (CFG011) for a missing, null or mistyped field; InvalidConfigError (CFG007) when the
        config has no routed experts at all.
    """
    text_config = raw.get("text_config")
    d = {**raw, **text_config} if isinstance(text_config, Mapping) else dict(raw)
    f = _Fields(d, source)
    model_type = f.string("model_type", default="")
    expert_keys, topk_keys = ("n_routed_experts", "num_experts", "moe_num_experts", "num_local_experts"), \
        ("num_experts_per_tok", "num_experts_per_token", "moe_top_k")
    if all(d.get(k) is None for k in expert_keys) and all(d.get(k) is None for k in topk_keys):
        raise InvalidConfigError(
            f"{source}: config has no routed-expert count or top-k (looked for n_routed_experts/num_experts/"
            "moe_num_experts and num_experts_per_tok/num_experts_per_token/moe_top_k); is it an MoE model?")
    num_experts = f.required_int(*expert_keys, what="the routed-expert count")
    num_topk = f.required_int(*topk_keys, what="the experts per token (top-k)")
    family = _family(model_type, source)
    is_step3 = family == "step3"
    use_latent = f.boolean("use_latent_moe", default=family == "kimi_k3")
    is_k3 = family == "kimi_k3" or (use_latent and family != "step3")
    family = "kimi_k3" if is_k3 else family
    # transformers' own DeepseekV3Config.to_dict() omits scoring_func: the family's router is sigmoid.
    default_scoring = "sigmoid" if family in ("deepseek_v3", "kimi_k2", "kimi_k3") else "softmax"
    scoring = f.string("scoring_func", "moe_router_activation_func", default=default_scoring)
    topk_method = f.string("topk_method", default="noaux_tc" if is_k3 else None)
    moe_intermediate = f.required_int("moe_intermediate_size", what="the routed expert's intermediate size")
    if is_step3:
        shared_size = f.optional_int("share_expert_dim", default=0)
        num_shared = 1 if shared_size else 0
        renorm = f.boolean("norm_expert_weight", default=False)
    else:
        num_shared = f.optional_int("n_shared_experts", "num_shared_experts", default=0)
        shared_size = num_shared * moe_intermediate
        renorm = f.boolean("norm_topk_prob", "moe_renormalize", default=scoring == "sigmoid")
    latent_dim = f.optional_int("latent_moe_dim", "routed_expert_hidden_size", "latent_dim") if (is_k3 and use_latent) \
        else None
    return dict(
        num_experts=num_experts,
        num_topk=num_topk,
        hidden_size=f.required_int("hidden_size", what="the hidden size"),
        intermediate_size=moe_intermediate,
        scoring=scoring,
        use_selection_bias=scoring == "sigmoid" and topk_method in ("noaux_tc", None) and not is_step3,
        renormalize=renorm,
        num_groups=f.optional_int("n_group", "num_expert_group", default=1),
        num_topk_groups=f.optional_int("topk_group", default=1),
        routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
        activation=f.string("hidden_act", default="silu").lower(),
        situ_beta=f.number("activation_situ_beta", default=4.0),
        situ_linear_beta=f.number("activation_situ_linear_beta", default=25.0),
        num_shared_experts=num_shared,
        shared_intermediate_size=shared_size,
        latent_dim=latent_dim or None,
        latent_norm=f.boolean("latent_moe_use_norm", default=True),
        rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
        family=family,
        name=str(raw.get("_name", model_type or "custom")),
        moe_layers=_moe_layers(f, is_step3),
    )


# model_type -> family: the families whose field names and routing rule from_hf_config maps. Step3's text
# config is "step3_text" (the VL wrapper "step3_vl" carries it as text_config, whose model_type wins).
HF_MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "kimi_k2": "kimi_k2", "kimi_k3": "kimi_k3", "step3": "step3",
                  "step3_text": "step3"}


def _family(model_type: str, source: str) -> str:
    """The family of ``model_type``; UnknownFamilyError (CFG018) for any other (no guessing from field names:
    a Qwen3-MoE config has ``num_experts`` and ``moe_intermediate_size`` too, but another router and no shared
    expert). ``custom`` is for MoEConfig(...) built in code only."""
    family = HF_MODEL_TYPES.get(model_type)
    if family is None:
        what = f"model_type {model_type!r}" if model_type else "no model_type"
        raise UnknownFamilyError(
            f"{source}: {what}: moe_ref does not know this model family's routing rule and tensor names, and "
            f"will not guess them from field names; supported model_types: {', '.join(HF_MODEL_TYPES)} "
            f"(DeepSeek-V3/R1, Kimi-K2, Kimi-K3, Step3). For a block of your own, build MoEConfig(...) in code "
            f"(family 'custom')", field="model_type", model_type=model_type)
    return family


def _moe_layers(f: _Fields, is_step3: bool) -> tuple[int, ...]:
    num_layers = f.optional_int("num_hidden_layers")
    layers_enum = f.string("moe_layers_enum", default=None) if is_step3 else None
    if layers_enum:
        try:
            return tuple(int(i) for i in layers_enum.split(",") if i.strip())
        except ValueError:
            raise f._bad("moe_layers_enum", layers_enum, "comma-separated layer numbers (\"4,5,6\")") from None
    if num_layers is None:
        return ()
    first_dense = f.optional_int("first_k_dense_replace", default=0)
    freq = f.optional_int("moe_layer_freq", default=1)
    if freq < 1:
        raise f._bad("moe_layer_freq", freq, "a positive integer")
    return tuple(i for i in range(first_dense, num_layers) if (i - first_dense) % freq == 0)


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
        cfg = dataclasses.replace(cfg, name=name, moe_layers=(), **_TINY_OVERRIDES[base])
    return cfg


def hf_config_dict(cfg: MoEConfig) -> dict[str, Any]:
    """A DeepSeek-V3/Kimi-K2/K3/Step3-style HF config dict for ``cfg`` (inverse of ``from_hf_config``;
    used to write synthetic checkpoints next to their config.json)."""
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
