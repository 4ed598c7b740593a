"""The whole journey, end to end: `make demo` / `python -m grouped_ep.demo`.

1. Make a tiny but real Hugging Face Qwen3-MoE checkpoint with transformers `save_pretrained`
   (several shard files), or take yours with `--checkpoint DIR`.
2. Launch `--world-size` ranks with torchrun (gloo on CPU, NCCL on GPU). Each rank builds the
   model on the meta device, shards its experts over the EP mesh, reads only its own bytes with
   `load_sharded`, applies FSDP2 with `fully_shard_moe`, and trains `--steps` steps on a small
   built-in text (byte-level tokens), then saves a distributed checkpoint.
3. Resume at `--resume-world-size` ranks (another EP/FSDP layout), train `--resume-steps` more,
   export to the Hugging Face layout.
4. Reload the export with plain transformers and compare its logits with the trained model's.
5. Print a summary table.

The global batch is the same at every world size (rank r takes sequences r, r + W, ...), so the
loss curve continues across the resume.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from grouped_ep._subprocess import run
from grouped_ep.demo.model import make_checkpoint


def torchrun(nproc: int, args: list[str], timeout: float) -> None:
    """Run `nproc` demo workers under torchrun, in their own process group (a timeout kills every
    rank, not just the launcher)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "grouped_ep.demo.worker",
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        proc = run(cmd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        sys.exit(
            f"demo: torchrun {args[0]} took longer than {timeout:.0f} s; every rank was killed"
        )
    if proc.returncode != 0:
        sys.exit(f"demo: torchrun {args[0]} failed with exit code {proc.returncode}")


_MARK = ".grouped_ep_demo"  # in every --out the demo made: only such a directory is replaced
# What a demo run writes into --out (a run from before the mark wrote these only).
_DEMO_FILES = {_MARK, "hf_initial", "ckpt", "logits.pt", "hf_export", "summary.json"}


def _fresh_out(out: Path, checkpoint: Path | None) -> None:
    """Empty `out` for this run; refuses a directory the demo did not make, or one holding the
    user's checkpoint (it would be deleted)."""
    if out.exists() and not out.is_dir():
        sys.exit(f"demo: --out {out} exists and is not a directory")
    if checkpoint is not None and checkpoint.resolve().is_relative_to(out.resolve()):
        sys.exit(f"demo: --checkpoint {checkpoint} is inside --out {out}, which the demo replaces")
    if out.exists() and not {p.name for p in out.iterdir()} <= _DEMO_FILES:
        sys.exit(
            f"demo: --out {out} holds files the demo did not write; name a new or empty directory"
        )
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / _MARK).write_text("made by python -m grouped_ep.demo; replaced by the next run\n")


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad arguments before anything is written or launched (exit code 2)."""
    from grouped_ep.demo.model import GLOBAL_BATCH, num_experts, tiny_qwen3_moe_config

    for name in ("steps", "resume_steps", "world_size", "resume_world_size", "timeout", "lr"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("world_size", "resume_world_size"):
        if GLOBAL_BATCH % getattr(args, name):
            ap.error(
                f"--{name.replace('_', '-')} {getattr(args, name)} must divide the global batch "
                f"of {GLOBAL_BATCH} sequences"
            )
    if args.checkpoint is None:
        experts = num_experts(tiny_qwen3_moe_config())
    else:
        config = args.checkpoint / "config.json"
        if not config.is_file():
            ap.error(
                f"--checkpoint {args.checkpoint}: no config.json there (a Hugging Face "
                "checkpoint directory holds config.json and *.safetensors)"
            )
        try:
            fields = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--checkpoint {args.checkpoint}: cannot read {config} ({e})")
        try:
            experts = num_experts(argparse.Namespace(**fields))
        except (ValueError, TypeError):
            ap.error(
                f"--checkpoint {args.checkpoint}: {config} names no expert count at its top "
                "level (num_experts, num_local_experts or n_routed_experts): the demo trains "
                "a causal LM MoE"
            )
    if args.ep is not None and (args.ep < 1 or args.world_size % args.ep or experts % args.ep):
        ap.error(
            f"--ep {args.ep} must divide the world size {args.world_size} and the {experts} experts"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m grouped_ep.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--checkpoint", type=Path, help="your Hugging Face MoE checkpoint directory")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("demo_out"),
        help="work directory: new, empty, or one an earlier demo run made (then replaced)",
    )
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--resume-world-size", type=int, default=1)
    ap.add_argument(
        "--ep",
        type=int,
        help="EP degree of the first run (default: 2 when the world size is a "
        "multiple of 4, so that EP and FSDP (dp > 1) run together; else the widest)",
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--resume-steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per torchrun phase")
    args = ap.parse_args(argv)
    if args.ep is None and args.world_size % 4 == 0:
        args.ep = 2
    _check_args(ap, args)

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    t_start = time.perf_counter()
    _fresh_out(args.out, args.checkpoint)
    if args.checkpoint is None:
        args.checkpoint = make_checkpoint(args.out / "hf_initial")
        files = sorted(p.name for p in args.checkpoint.glob("*.safetensors"))
        print(
            f"demo: wrote a tiny Qwen3-MoE with transformers save_pretrained: {len(files)} shard files"
        )
    common = [
        "--checkpoint",
        str(args.checkpoint),
        "--out",
        str(args.out),
        "--device",
        device,
        "--lr",
        str(args.lr),
    ]
    print(f"demo: training on {args.world_size} ranks ({device})", flush=True)
    torchrun(
        args.world_size,
        [
            "train",
            "--steps",
            str(args.steps),
            *(["--ep", str(args.ep)] if args.ep else []),
            *common,
        ],
        args.timeout,
    )
    print(f"demo: resuming on {args.resume_world_size} ranks", flush=True)
    torchrun(
        args.resume_world_size,
        ["resume", "--steps", str(args.resume_steps), *common],
        args.timeout,
    )
    compare_logits(args.out)
    print_summary(args.out, time.perf_counter() - t_start)
    return 0


def compare_logits(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from grouped_ep.demo.model import eval_batch

    model = AutoModelForCausalLM.from_pretrained(out / "hf_export", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(eval_batch()).logits
    trained = torch.load(out / "logits.pt")
    diff = (logits - trained).abs().max().item()
    summary = json.loads((out / "summary.json").read_text())
    summary["export"]["logits_max_abs_diff"] = diff
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not diff <= 1e-4:
        sys.exit(
            f"demo: transformers' logits of the export differ from the trained model by {diff}"
        )


def expert_load_rows(phase: str, record: dict) -> list[tuple[str, str, str]]:
    """One summary row per MoE layer: min / max routed tokens per expert over the phase (all
    ranks and steps), and max / mean."""
    rows = []
    for layer, counts in enumerate(record.get("tokens_per_expert", [])):
        mean = sum(counts) / max(len(counts), 1)
        rows.append(
            (
                phase,
                f"layer {layer} tokens per expert min / max",
                f"{min(counts):,} / {max(counts):,} (max / mean {max(counts) / max(mean, 1):.2f})",
            )
        )
    return rows


def print_summary(out: Path, seconds: float) -> None:
    s = json.loads((out / "summary.json").read_text())
    rows = [("phase", "what", "value")]
    for r in s["train"]["load"]:
        rows.append(
            (
                "load_sharded",
                f"rank {r['rank']} bytes read / owned",
                f"{r['bytes_read']:,} / {r['bytes_owned']:,} = {r['bytes_read'] / max(r['bytes_owned'], 1):.2f}",
            )
        )
    t, r = s["train"], s["resume"]
    rows += [
        ("train", "layout", f"world {t['world']} = dp {t['dp']} x ep {t['ep']}"),
        (
            "train",
            "loss first -> last",
            f"{t['losses'][0]:.4f} -> {t['losses'][-1]:.4f} ({len(t['losses'])} steps)",
        ),
        ("train", "save seconds", f"{t['save_seconds']:.2f}"),
        *expert_load_rows("train", t),
        ("resume", "layout", f"world {r['world']} = dp {r['dp']} x ep {r['ep']}"),
        ("resume", "load seconds", f"{r['load_seconds']:.2f}"),
        (
            "resume",
            "loss first -> last",
            f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} ({len(r['losses'])} steps)",
        ),
        *expert_load_rows("resume", r),
        ("export", "export_hf seconds", f"{s['export']['seconds']:.2f}"),
        (
            "export",
            "logits max |diff| vs transformers",
            f"{s['export']['logits_max_abs_diff']:.2e}",
        ),
        ("all", "wall seconds", f"{seconds:.1f}"),
    ]
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, width)) + " |"  # noqa: E731
    print("\n" + line(rows[0]) + "\n|" + "|".join("-" * (w + 2) for w in width) + "|")
    for row in rows[1:]:
        print(line(row))
    print(f"\ndemo: summary in {out / 'summary.json'}")


if __name__ == "__main__":
    sys.exit(main())
