"""MoE layer forward + backward: a transformers Qwen3-MoE sparse block run with
`experts_implementation="grouped_ep"` vs transformers' own "grouped_mm" (torch grouped_mm or its
fallback loop) and "eager" (per-expert loop) paths, on the same weights and tokens. The router
is transformers' for every row; each experts implementation does its own token permutation,
expert GEMMs and weighted combine, and each timing includes them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from suites._timing import median_seconds

TITLE = (
    "MoE layer fwd+bwd, transformers Qwen3-MoE block (ms; *_x = baseline time / grouped_ep time)"
)

IMPLS = ("grouped_ep", "grouped_mm", "eager")


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    inter: int  # moe_intermediate_size
    experts: int
    top_k: int


# Scaled for a 2-core CPU; shapes shaped like the models they are named after.
CPU_CASES = [
    Case("qwen3-like", 1024, 512, 256, 16, 4),
    Case("mixtral-like", 512, 512, 1024, 8, 2),
    Case("many-small-experts", 2048, 256, 128, 64, 8),
]
GPU_CASES = [
    Case("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    Case("mixtral-8x7b", 4096, 4096, 14336, 8, 2),
    Case("deepseek-v3-dims-E32-top8", 8192, 7168, 2048, 32, 8),
]


def _block(case: Case, device: str, dtype: torch.dtype):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    import grouped_ep.hf  # noqa: F401  (registers "grouped_ep")
    from grouped_ep.demo.model import tiny_qwen3_moe_config

    config = tiny_qwen3_moe_config(
        hidden_size=case.hidden,
        moe_intermediate_size=case.inter,
        num_experts=case.experts,
        num_experts_per_tok=case.top_k,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, case.hidden**-0.5)
    return block.to(device=device, dtype=dtype)


def _step(block, x: torch.Tensor, dy: torch.Tensor):
    def fn():
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = block(x)
        y.backward(dy)
        return y

    return fn


def run(device: str, quick: bool, log, rows: list | None = None) -> list[dict]:
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    cases = GPU_CASES if cuda else CPU_CASES
    if quick:  # two cases at half the tokens, fewer repeats
        cases = [replace(c, tokens=c.tokens // 2) for c in cases[:2]]
    reps = 3 if quick else 10
    rows = [] if rows is None else rows  # the runner's list: rows finished so far survive a stop
    for case in cases:
        block = _block(case, device, dtype)
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(1, case.tokens, case.hidden, device=device, dtype=dtype, generator=g)
        x.requires_grad_(True)
        dy = torch.randn(x.shape, device=device, dtype=dtype, generator=g)
        times, outs = {}, {}
        for impl in IMPLS:
            block.experts.config._experts_implementation = impl
            fn = _step(block, x, dy)
            outs[impl] = fn().detach().float()
            times[impl] = median_seconds(fn, device, reps=reps, warmup=2)
        # fwd 2 GEMMs of 2*T*k*H*(2I) and 2*T*k*I*H FLOPs; bwd twice that.
        flops = 3 * 6 * case.tokens * case.top_k * case.hidden * case.inter
        ref = outs["eager"]
        row = {
            "case": case.name,
            "tokens": case.tokens,
            "experts": case.experts,
            "top_k": case.top_k,
            "hidden": case.hidden,
            "inter": case.inter,
            "dtype": str(dtype).removeprefix("torch."),
        }
        for impl in IMPLS:
            row[f"{impl}_ms"] = times[impl] * 1e3
        row["grouped_ep_gflops"] = flops / times["grouped_ep"] / 1e9
        row["max_abs_diff_vs_eager"] = (outs["grouped_ep"] - ref).abs().max().item()
        row["grouped_mm_diff_vs_eager"] = (outs["grouped_mm"] - ref).abs().max().item()
        row["grouped_mm_x"] = times["grouped_mm"] / times["grouped_ep"]
        row["eager_x"] = times["eager"] / times["grouped_ep"]
        log(
            f"{case.name}: grouped_ep {row['grouped_ep_ms']:.1f} ms, grouped_mm "
            f"{row['grouped_mm_ms']:.1f} ms ({row['grouped_mm_x']:.2f}x), eager "
            f"{row['eager_ms']:.1f} ms ({row['eager_x']:.2f}x)"
        )
        rows.append(row)
    return rows
