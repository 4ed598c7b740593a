"""One rank of `python -m grouped_ep.demo`: `python -m grouped_ep.demo.worker {train,resume} ...`,
started by torchrun. `train` loads the Hugging Face checkpoint with `load_sharded`, trains and
saves; `resume` loads that checkpoint at another world size, trains on and exports."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grouped_ep.demo.model import GLOBAL_BATCH, batch, eval_batch, factor, num_experts


class Progress:
    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled, self.t0 = total, label, enabled, time.perf_counter()

    def step(self, i: int, loss: float) -> None:
        if not self.enabled:
            return
        done = int(20 * i / self.total)
        rate = (time.perf_counter() - self.t0) / i
        print(
            f"{self.label} step {i:3d}/{self.total} [{'#' * done}{'.' * (20 - done)}] "
            f"loss {loss:.4f}  {rate:.2f} s/step",
            flush=True,
        )


def worker(args) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    import grouped_ep.hf as ge_hf
    from grouped_ep import checkpoint, load_sharded
    from grouped_ep.hf import init_nonpersistent_buffers
    from grouped_ep.moe import ExpertLoadCounter
    from grouped_ep.parallel import apply_expert_parallel, make_mesh

    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        sys.exit(f"demo: the world size {world} must divide the global batch {GLOBAL_BATCH}")
    out = Path(args.out)
    config = AutoConfig.from_pretrained(args.checkpoint)
    dp, ep = factor(world, getattr(args, "ep", None), num_experts(config))
    mesh = make_mesh(dp, ep, device_type=device.type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.set_experts_implementation(ge_hf.IMPLEMENTATION)
    summary: dict = {}

    if args.phase == "train":
        apply_expert_parallel(model, mesh["ep"])  # experts: Shard(0) DTensors, still on meta
        # Only this rank's bytes; rotary buffers (in no checkpoint) recomputed on `device`.
        report = load_sharded(model, args.checkpoint, device=device)
        ge_hf.parallelize(model, mesh)
        reports = [None] * world
        dist.all_gather_object(reports, {"rank": rank, **vars(report)})
        summary["train"] = {"world": world, "dp": dp, "ep": ep, "load": reports}
    else:
        ge_hf.parallelize(model, mesh)
        model.to_empty(device=device)
        init_nonpersistent_buffers(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    first_step = 0
    if args.phase == "resume":
        t0 = time.perf_counter()
        extra = checkpoint.load(out / "ckpt", model, optimizer)
        first_step = extra["step"]
        summary = json.loads((out / "summary.json").read_text()) if rank == 0 else {}
        summary["resume"] = {
            "world": world,
            "dp": dp,
            "ep": ep,
            "load_seconds": time.perf_counter() - t0,
        }

    losses = []
    progress = Progress(args.steps, args.phase, rank == 0)
    load_counter = ExpertLoadCounter(model)  # tokens per expert, counted in the experts' forward
    model.train()
    for i in range(1, args.steps + 1):
        inputs, labels = batch(first_step + i, rank, world)
        logits = model(input_ids=inputs.to(device)).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        progress.step(i, losses[-1])
    counts = load_counter.global_counts()  # [layers, experts], all ranks and steps
    load_counter.remove()
    phase = summary[args.phase]
    phase["losses"] = losses
    phase["tokens_per_expert"] = counts.tolist()

    if args.phase == "train":
        t0 = time.perf_counter()
        checkpoint.save(out / "ckpt", model, optimizer, extra={"step": args.steps})
        phase["save_seconds"] = time.perf_counter() - t0
    else:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=eval_batch().to(device)).logits
        if rank == 0:
            torch.save(logits.float().cpu(), out / "logits.pt")
        t0 = time.perf_counter()
        checkpoint.export_hf(model, out / "hf_export")
        summary["export"] = {"seconds": time.perf_counter() - t0}
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grouped_ep.demo.worker")
    ap.add_argument("phase", choices=["train", "resume"])
    ap.add_argument("--checkpoint", required=True, help="the Hugging Face checkpoint directory")
    ap.add_argument("--out", required=True, help="the demo's work directory")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ep", type=int, help="EP degree (default: widest)")
    ap.add_argument("--lr", type=float, default=3e-3)
    return worker(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
