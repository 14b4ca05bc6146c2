"""Tiny transformers causal LMs of every MoE family, built from their own config classes (seeded, fp32, CPU): 2
decoder layers where the family has a dense-layer rule (layer 0 dense, layer 1 MoE), hidden 64, 8 experts, top-2.

``tiny_model(model_type, seed)`` builds one; ``MODEL_TYPES`` lists them. Used by the transformers integration tests
(``tests/unit/test_integrations_transformers.py``) and their torchrun worker."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

import transformers

HIDDEN, EXPERTS, TOPK, VOCAB = 64, 8, 2, 128
# every config: vocab, hidden, 2 layers, 4 heads of 16, short positions, a larger init so the MoE blocks matter
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False)
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            num_key_value_heads=4)

CONFIGS = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        **{**_COMMON, **_MLA}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOPK, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek_v2": ("DeepseekV2Config", dict(
        **{**_COMMON, **_MLA}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOPK, n_group=2, topk_group=1, topk_method="group_limited_greedy", n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=1.5)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        **_COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=EXPERTS,
        num_experts_per_tok=TOPK, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        **_COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=EXPERTS,
        num_experts_per_tok=TOPK, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        **_COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", dict(
        **_COMMON, head_dim=16, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOPK)),
    "olmoe": ("OlmoeConfig", dict(
        **_COMMON, intermediate_size=32, num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=False)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(
        **_COMMON, intermediate_size=96, moe_intermediate_size=32, moe_num_experts=EXPERTS, moe_k=TOPK,
        moe_num_shared_experts=1, moe_layer_start_index=1)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(
        **_COMMON, head_dim=16, intermediate_size=32, num_experts=EXPERTS, moe_topk=TOPK)),
    "gpt_oss": ("GptOssConfig", dict(
        **_COMMON, head_dim=16, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOPK,
        layer_types=["full_attention", "full_attention"])),
}
MODEL_TYPES = tuple(CONFIGS)


def tiny_config(model_type: str, **overrides):
    class_name, fields = CONFIGS[model_type]
    return getattr(transformers, class_name)(**{**fields, **overrides})


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """The family's causal LM, seeded, fp32, eval mode, on the CPU."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides),
                                                          dtype=torch.float32)
    return model.eval()


def saved_once(folder: Path) -> Callable[[str], Path]:
    """``save(model_type)``: the family's tiny model written with ``save_pretrained`` under ``folder`` (once per
    type; later calls return the same folder)."""
    def save(model_type: str) -> Path:
        path = folder / model_type
        if not path.exists():
            tiny_model(model_type).save_pretrained(path)
        return path
    return save


def prompt(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    """``[batch, length]`` int64 token ids."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
