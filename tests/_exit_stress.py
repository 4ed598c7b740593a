"""Issue 18's scenario, repeated: jobs of 2 or 4 gloo ranks that each build transformers' Mixtral
on the meta device, EP-shard it (`grouped_ep.hf.parallelize`), `load_sharded` a Mixtral-naming
checkpoint written by `save_pretrained`, check every local weight against transformers'
`from_pretrained`, `destroy_process_group()`, and exit the normal way (interpreter
finalization, C++ static destructors), with the model still alive at exit.

    python tests/_exit_stress.py OUT_DIR --jobs 100 --worlds 2,4 [--busy]

Each rank is a fork of this interpreter, made after torch, transformers and grouped_ep were
imported (so a job costs its load and its exit, not the imports), which then runs to a normal
interpreter exit. `--busy` keeps a CPU-bound process running meanwhile (the abort was seen on a
busy machine). Prints one JSON line: jobs, the ranks that died or printed 'terminate called',
their exit codes or signals, and the path of each bad rank's log.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's grouped_ep

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402, F401  (imported before the forks)
from transformers import MixtralForCausalLM  # noqa: E402, F401

import grouped_ep  # noqa: E402
import grouped_ep.hf  # noqa: E402
from grouped_ep.parallel import make_mesh  # noqa: E402

_KEEP = []  # the loaded model stays alive until interpreter exit, as in a user's script


def make_checkpoint(directory: Path) -> Path:
    """A 4-expert Mixtral written by transformers' own save_pretrained (several shards), and the
    state dict its from_pretrained builds (ref.pt)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _ckpt_helpers import from_pretrained_state, save_hf, tiny_mixtral_config

    save_hf(directory, tiny_mixtral_config(experts=4), seed=1, max_shard_size="20KB")
    torch.save(from_pretrained_state(directory), directory / "ref.pt")
    return directory


def rank_body(checkpoint: str) -> None:
    """One rank of one job (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = make_mesh(dp=1, ep=world, device_type="cpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    grouped_ep.hf.parallelize(model, mesh)
    report = grouped_ep.load_sharded(model, checkpoint, device="cpu", progress=False)
    ref = torch.load(f"{checkpoint}/ref.pt")
    checked = 0
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if not torch.equal(full, ref[name]):
            raise AssertionError(f"rank {dist.get_rank()}: {name} differs from from_pretrained")
        checked += 1
    if checked != len(ref) or report.bytes_read != report.bytes_owned:
        raise AssertionError(f"checked {checked} of {len(ref)}; report {report}")
    _KEEP.append(model)
    dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']} ok", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy() -> int:
    pid = os.fork()
    if pid == 0:
        os.nice(10)
        while True:
            pass
    return pid


def run_jobs(out: Path, jobs: int, worlds: list[int], checkpoint: str, busy: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    busy_pid = _busy() if busy else None
    bad: list[dict] = []
    t0 = time.perf_counter()
    try:
        for job in range(jobs):
            world = worlds[job % len(worlds)]
            port, ranks = _free_port(), {}
            for rank in range(world):
                log = out / f"job{job}_rank{rank}.log"
                pid = os.fork()
                if pid == 0:  # the rank: run, then a normal interpreter exit (SystemExit)
                    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.environ |= {
                        "RANK": str(rank),
                        "WORLD_SIZE": str(world),
                        "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                    }
                    code = 0
                    try:
                        rank_body(checkpoint)
                    except BaseException:
                        import traceback

                        traceback.print_exc()
                        code = 1
                    raise SystemExit(code)
                ranks[pid] = (rank, log)
            for pid, (rank, log) in ranks.items():
                _, status = os.waitpid(pid, 0)
                text = log.read_text(errors="replace")
                signal_ = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
                if signal_ or code or "terminate called" in text:
                    bad.append(
                        {"job": job, "world": world, "rank": rank, "signal": signal_,
                         "exit_code": code, "terminate": "terminate called" in text,
                         "log": str(log)}
                    )  # fmt: skip
                else:
                    log.unlink()
            print(f"job {job} world {world}: {len(bad)} bad rank(s) so far", file=sys.stderr,
                  flush=True)  # fmt: skip
    finally:  # a rank unwinds through here on its way to exit: only the parent cleans up
        if busy_pid and os.getpid() == parent:
            os.kill(busy_pid, 9)
            os.waitpid(busy_pid, 0)
    return {"jobs": jobs, "worlds": worlds, "bad": bad, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--checkpoint", default=None, help="default: written into OUT/ckpt")
    ap.add_argument("--busy", action="store_true")
    args = ap.parse_args()
    ckpt = args.checkpoint or str(make_checkpoint(args.out / "ckpt"))
    worlds = [int(w) for w in args.worlds.split(",")]
    result = run_jobs(args.out, args.jobs, worlds, ckpt, args.busy)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
