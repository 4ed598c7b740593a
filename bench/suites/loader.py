"""Sharded safetensors loading: grouped_ep.load_sharded vs a safetensors `get_slice` loop reading
the same slices vs reading every file whole and slicing, on 1, 2 and 4 ranks (processes).

The checkpoint is written here (bf16, per-expert 2-D keys as transformers' save_pretrained
writes them, several files); the model is a meta-device module whose experts are DTensor
`Shard(0)` over an EP mesh of all ranks; dense weights are replicated (read whole by every rank).

Columns (per ranks x method x cache; timing and memory are the worst rank):
  gbps            bytes owned by all ranks / seconds of the slowest rank
  read_ratio      bytes read per rank / bytes owned: grouped_ep's own byte counter, read() bytes
                  (/proc/self/io rchar) for read_whole; for get_slice (mmap, invisible to rchar)
                  the storage-layer read_bytes in cold runs, n/a in hot ones
  rchar_ratio     read()/pread() bytes the kernel counted for the rank (/proc/self/io rchar,
                  headers included) / bytes owned: an independent check of grouped_ep's counter
  peak_rss_mib    ru_maxrss of the rank process; rss_growth_mib: peak (VmHWM, reset at start)
                  minus the RSS before loading; local_mib: the rank's local shard
  same_data       (grouped_ep rows) every rank's local tensors are byte-identical under the three
                  methods (sha256 of names, dtypes, shapes and bytes)
  minor_faults    page faults of the rank during the load (ru_minflt): first touches of fresh
                  memory, and for get_slice the mmap of the file itself
  seq_read        (one row per ranks x cache) the disk's limit: one process reads every file whole,
                  in file order, in 16 MiB reads into one reused, already-faulted buffer; gbps is
                  file bytes / seconds. vs_seq_read_x (grouped_ep rows) = grouped_ep GB/s of owned
                  bytes / seq_read GB/s in the same run and cache state
  cold            the files' pages evicted first (posix_fadvise DONTNEED after fsync, or
                  drop_caches), with the fraction still resident (mincore) in `resident`;
                  hot: every file read once just before

Every configuration runs in fresh rank processes (forked from a forkserver that has imported
torch); the ranks pass a barrier, then load. Per (ranks, cache) the sequential read and the three
methods run in `reps` rounds, one of each per round, and each keeps its best round (the machine
may be shared: interleaving spreads a slow spell over every method).
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from suites._pagecache import evict, resident_fraction, sequential_read, warm
from suites.loader_quant import quant_rows

TITLE = "sharded safetensors loading (GB/s of owned bytes; *_x = grouped_ep speed / baseline)"
METHODS = ("grouped_ep", "get_slice", "read_whole")


@dataclass(frozen=True)
class Spec:
    layers: int
    experts: int
    hidden: int
    inter: int
    shard_bytes: int

    @property
    def expert_bytes(self) -> int:  # gate + up + down of one expert, bf16
        return 3 * self.hidden * self.inter * 2


FULL = Spec(layers=20, experts=16, hidden=1024, inter=1024, shard_bytes=256 << 20)  # ~2.1 GB
QUICK = Spec(layers=2, experts=16, hidden=1024, inter=1024, shard_bytes=64 << 20)  # ~210 MB


def _expert_keys(layer: int, i: int) -> list[str]:
    return [
        f"layers.{layer}.mlp.experts.{i}.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")
    ]


def write_checkpoint(directory: Path, spec: Spec) -> int:
    """Write the checkpoint in shards of about `spec.shard_bytes`; returns the data bytes."""
    import json

    from safetensors.torch import save_file

    h, n = spec.hidden, spec.inter
    base = torch.linspace(-1, 1, h * n).view(n, h)
    tensors: list[tuple[str, torch.Tensor]] = []
    for layer in range(spec.layers):
        attn = torch.linspace(-1, 1, h * h).view(h, h) * 0.5 + layer
        tensors.append((f"layers.{layer}.attn.weight", attn.bfloat16()))
        for i in range(spec.experts):
            seed = layer * spec.experts + i
            gate, up, down = _expert_keys(layer, i)
            tensors.append((gate, (base + seed).bfloat16()))
            tensors.append((up, (base - seed).bfloat16()))
            tensors.append((down, (base.t() * seed).contiguous().bfloat16()))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors:
        if size + t.nbytes > spec.shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.nbytes
    weight_map = {}
    for s, shard in enumerate(shards):
        name = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name))
        weight_map.update(dict.fromkeys(shard, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(t.nbytes for _, t in tensors)


# ---- one rank --------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _io(field: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every local tensor's name, dtype, shape and bytes (by name): unlike a sum, it
    sees swapped gate/up halves, transposes and permuted rows or experts."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _model(spec: Spec, mesh, device: str):
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    root = nn.Module()
    root.layers = nn.ModuleList()
    e, h, n = spec.experts, spec.hidden, spec.inter
    for _ in range(spec.layers):
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.experts = nn.Module()
        with torch.device("meta"):
            layer.attn = nn.Linear(h, h, bias=False, dtype=torch.bfloat16)
            gate_up = torch.empty(e, 2 * n, h, dtype=torch.bfloat16)
            down = torch.empty(e, h, n, dtype=torch.bfloat16)
        for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
            d = distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
            setattr(layer.mlp.experts, name, nn.Parameter(d))
        root.layers.append(layer)
    return root


def _baseline(method: str, spec: Spec, ckpt: Path, rank: int, world: int, device: str) -> dict:
    """get_slice / read_whole: the same local tensors, filled from safetensors."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load as load_bytes

    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    per = -(-spec.experts // world)
    first, last = min(rank * per, spec.experts), min((rank + 1) * per, spec.experts)
    n, h = spec.inter, spec.hidden
    locals_: dict[str, torch.Tensor] = {}
    # key -> (destination view) for every slice this rank owns
    dests: dict[str, torch.Tensor] = {}
    for layer in range(spec.layers):
        gu = torch.empty(last - first, 2 * n, h, dtype=torch.bfloat16, device=device)
        dn = torch.empty(last - first, h, n, dtype=torch.bfloat16, device=device)
        at = torch.empty(h, h, dtype=torch.bfloat16, device=device)
        experts = f"layers.{layer}.mlp.experts"  # the names of the grouped_ep model's state_dict
        locals_ |= {
            f"layers.{layer}.attn.weight": at,
            f"{experts}.gate_up_proj": gu,
            f"{experts}.down_proj": dn,
        }
        dests[f"layers.{layer}.attn.weight"] = at
        for j, i in enumerate(range(first, last)):
            gate, up, down = _expert_keys(layer, i)
            dests |= {gate: gu[j, :n], up: gu[j, n:], down: dn[j]}
    by_file: dict[str, list[str]] = {}
    for key in dests:
        by_file.setdefault(weight_map[key], []).append(key)
    if method == "get_slice":
        for name, keys in by_file.items():
            with safe_open(str(ckpt / name), framework="pt") as f:
                for key in keys:
                    dests[key].copy_(f.get_slice(key)[:])
    else:
        for name in sorted(set(weight_map.values())):
            with open(ckpt / name, "rb") as f:
                data = f.read()
            state = load_bytes(data)
            for key in by_file.get(name, []):
                dests[key].copy_(state[key])
            del data, state
    return locals_


def rank_main(rank, world, port, method, spec, ckpt, device, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        # LOCAL_WORLD_SIZE as torchrun sets it (grouped_ep sizes its thread pool with it).
        os.environ |= {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_WORLD_SIZE": str(world),
        }
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        from grouped_ep import load_sharded

        model = _model(spec, mesh, device) if method == "grouped_ep" else None
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        dist.barrier()  # start together: no rank's start-up overlaps another's load
        rss0, rchar0, storage0 = _rss_kib("VmRSS"), _io("rchar"), _io("read_bytes")
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        if method == "grouped_ep":
            report = load_sharded(model, ckpt, device=device, progress=False)
            tensors = {
                k: t.to_local() if hasattr(t, "to_local") else t
                for k, t in model.state_dict().items()
            }
            counted = report.bytes_read
        else:
            tensors = _baseline(method, spec, Path(ckpt), rank, world, device)
            counted = None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        maxrss, growth = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            _rss_kib("VmHWM") - rss0,
        )
        owned = sum(t.numel() * t.element_size() for t in tensors.values())
        digest = _digest(tensors)
        results.put(
            {
                "rank": rank,
                "seconds": seconds,
                "owned": owned,
                "counted": counted,
                "rchar": _io("rchar") - rchar0,
                "storage": _io("read_bytes") - storage0,
                "maxrss_kib": maxrss,
                "growth_kib": growth,
                "digest": digest,
                "faults": faults,
            }
        )
        dist.destroy_process_group()
    except BaseException as e:  # report instead of hanging the parent
        results.put({"rank": rank, "error": repr(e)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(ctx, world, method, spec, ckpt, device, timeout=300) -> list[dict]:
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=rank_main, args=(r, world, port, method, spec, str(ckpt), device, results)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in range(world):
            out.append(results.get(timeout=timeout))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in out if "error" in r]
    if errors:
        raise RuntimeError(f"loader bench {method} x{world}: {errors[0]}")
    return sorted(out, key=lambda r: r["rank"])


def run(device: str, quick: bool, log, rows: list | None = None) -> list[dict]:
    import torch.multiprocessing as mp

    spec, reps = (QUICK, 1) if quick else (FULL, 3)
    dev = "cuda" if device.startswith("cuda") else "cpu"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed.tensor",
            "grouped_ep.loading",
            "safetensors.torch",
            "suites.loader",
        ]
    )
    tmp = Path(tempfile.mkdtemp(prefix="grouped_ep_loader_bench_"))
    rows = [] if rows is None else rows  # the runner's list: rows finished so far survive a stop
    bf16_speed: dict[int, float] = {}
    try:
        t0 = time.perf_counter()
        total = write_checkpoint(tmp, spec)
        files = sorted(tmp.glob("*.safetensors"))
        log(
            f"loader: wrote {total / 1e9:.2f} GB in {len(files)} files ({time.perf_counter() - t0:.1f} s)"
        )
        for world in (1, 2, 4):
            for cache in ("cold", "hot"):
                speed: dict[str, float] = {}
                digests: dict[str, list[str]] = {}
                # `reps` rounds of the disk's limit and every method in turn, the best round of
                # each kept: the machine may be shared and noisy, and a slow spell then hits
                # every method instead of the one that happened to run during it.
                seq: list[tuple[float, int, float, str]] = []
                trials: dict[str, list] = {m: [] for m in METHODS}
                run_s: dict[str, float] = dict.fromkeys(METHODS, 0.0)
                state: dict[str, tuple] = {}

                def prepare(cache: str = cache) -> tuple[str, float]:
                    how = evict(files) if cache == "cold" else (warm(files) or "warm read")
                    return how, resident_fraction(files)

                for _rep in range(reps):
                    how, resident = prepare()
                    nbytes, secs = sequential_read(files)
                    seq.append((secs, nbytes, resident, how))
                    for method in METHODS:
                        state[method] = prepare()
                        t_run = time.perf_counter()
                        trials[method].append(_run_ranks(ctx, world, method, spec, tmp, dev))
                        run_s[method] += time.perf_counter() - t_run
                secs, nbytes, resident, how = min(seq)
                seq_gbps = nbytes / secs / 1e9
                rows.append(
                    {"case": f"seq_read-x{world}-{cache}", "ranks": world, "seconds": secs,
                     "gbps": seq_gbps, "resident": resident, "evicted_by": how, "reps": reps}
                )  # fmt: skip
                log(f"loader: seq_read-x{world}-{cache:<13} {seq_gbps:6.2f} GB/s (disk limit)")
                for method in METHODS:
                    how, resident = state[method]
                    t_run = run_s[method]
                    ranks = min(trials[method], key=lambda rs: max(r["seconds"] for r in rs))
                    secs = max(r["seconds"] for r in ranks)
                    owned = sum(r["owned"] for r in ranks)
                    if method == "grouped_ep":
                        ratio = max(r["counted"] / r["owned"] for r in ranks)
                    elif method == "read_whole":
                        ratio = max(r["rchar"] / r["owned"] for r in ranks)
                    else:
                        ratio = (
                            max(r["storage"] / r["owned"] for r in ranks)
                            if cache == "cold"
                            else float("nan")
                        )
                    speed[method] = owned / secs
                    digests[method] = [r["digest"] for r in ranks]
                    row = {
                        "case": f"{method}-x{world}-{cache}",
                        "ranks": world,
                        "seconds": secs,
                        "gbps": owned / secs / 1e9,
                        "read_ratio": ratio,
                        "rchar_ratio": max(r["rchar"] / r["owned"] for r in ranks),
                        "peak_rss_mib": max(r["maxrss_kib"] for r in ranks) / 1024,
                        "rss_growth_mib": max(r["growth_kib"] for r in ranks) / 1024,
                        "local_mib": max(r["owned"] for r in ranks) / 2**20,
                        "minor_faults": max(r["faults"] for r in ranks),
                        "resident": resident,
                        "evicted_by": how,
                        "reps": reps,
                    }
                    rows.append(row)
                    log(
                        f"loader: {row['case']:<24} {row['gbps']:6.2f} GB/s  read/owned "
                        f"{ratio:.3f}  rss +{row['rss_growth_mib']:.0f} MiB (local "
                        f"{row['local_mib']:.0f} MiB)  resident {resident:.2f}  ({t_run:.1f} s)"
                    )
                if cache == "hot":
                    bf16_speed[world] = speed["grouped_ep"]
                for row in rows[-len(METHODS) :]:
                    if row["case"].startswith("grouped_ep"):
                        row["vs_get_slice_x"] = speed["grouped_ep"] / speed["get_slice"]
                        row["vs_read_whole_x"] = speed["grouped_ep"] / speed["read_whole"]
                        row["vs_seq_read_x"] = speed["grouped_ep"] / 1e9 / seq_gbps
                        row["same_data"] = (
                            digests["grouped_ep"] == digests["get_slice"] == digests["read_whole"]
                        )
        # Quantized copies of the same checkpoint, dequantized on read (bench/suites/loader_quant.py).
        quant_rows(ctx, spec, tmp, dev, reps, bf16_speed, _run_ranks, warm, log, rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows
