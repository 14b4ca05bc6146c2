"""Benchmarking code that scripts/ share, in the package so that no script imports another (stage 6: it may import
any lower stage, and nothing below it imports it). The scripts are the entry points; what they run lives here:

    cases        expert-MLP cases at per-rank EP8 shapes (Kimi-K2, Step3): routed rows, pools, weights
    timing       do_bench with L2 flushed, profiler kernel time, kernel tables, runtime calls, host/wall us
    expert_rows  the rows scripts/bench_experts.py times (public API, kernels, torch, DeepGEMM, peers) and their checks
    expert_report  those rows' metrics, labels, markdown and plot
    ranks        one code path for torchrun ranks and one plain process (world 1, no group)
    layer_paths  the routed-step paths of scripts/bench_layer.py and scripts/profile_step.py
    w4_cases     the 4-bit experts' shape, weights and rows of scripts/bench_w4a16.py and scripts/ab_w4_decode.py
    peers/       SGLang's and vLLM's fused-MoE Triton kernels read from their wheels (scripts/peer_moe.py)
"""
