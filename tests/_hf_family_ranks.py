"""What the rank processes of tests/test_hf_families.py run, in a module of its own: a rank
imports the module its function lives in, and the test module finds its families when imported
(every `modeling_*` module of transformers, each tiny model built and run: about 20 s per rank).
Here a rank imports only the families it is given (`_hf_families.family`)."""

from __future__ import annotations

import warnings

import torch
import transformers
from _hf_families import build, family, tiny_config

SEQ = 7
warnings.filterwarnings("ignore", module="transformers")


def ids(world: int) -> torch.Tensor:
    """`[world, 2, SEQ]` token ids, rank r's batch at `[r]`."""
    return torch.randint(3, 64, (world, 2, SEQ), generator=torch.Generator().manual_seed(1))


def logits_and_grads(model, tokens):
    model.zero_grad()
    out = model(tokens, use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    return out.logits.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def ep_worker(rank: int, world: int, root: str, names: list[str], dp: int) -> dict:
    """Per family: meta build -> parallelize -> load_sharded -> forward, backward, AdamW,
    checkpoint.save. Errors are kept per family (a family failing alone does not stop the rest
    as long as every rank fails the same way)."""
    from grouped_ep import checkpoint, load_sharded
    from grouped_ep.hf import parallelize
    from grouped_ep.parallel import make_mesh

    transformers.logging.set_verbosity_error()
    mesh = make_mesh(dp, world // dp)
    tokens = ids(world)[rank]
    out = {}
    for name in names:
        try:
            fam = family(name)
            with torch.device("meta"):
                model = fam.model_class(tiny_config(fam))
            parallelize(model, mesh)
            load_sharded(model, f"{root}/{name}/hf", device="cpu")
            # Compared forwards run in eval mode: some routers add noise in training (phimoe's
            # sparsemixer jitter), and the reference is an eval forward.
            model.eval()
            with torch.no_grad():
                res = {"logits": model(tokens, use_cache=False).logits}
            model.train()
            logits = model(tokens, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
            # The per-tensor loop (CPU's default): foreach over DTensors is tested in
            # test_parallel_dist; here, over 65 families of other shapes each, its uncached
            # sharding propagation took a third of the ranks' time.
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            opt.step()
            model.eval()
            with torch.no_grad():
                res["after"] = model(tokens, use_cache=False).logits
            checkpoint.save(f"{root}/{name}/ckpt", model, opt, step=1)
            out[name] = res
        except Exception as e:  # noqa: BLE001 (kept per family, asserted by the test)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def resume_worker(rank: int, world: int, root: str, names: list[str]) -> dict:
    """Per family: the 2-rank checkpoint loaded at this world size, logits after the step."""
    from grouped_ep import checkpoint
    from grouped_ep.hf import parallelize
    from grouped_ep.parallel import make_mesh

    transformers.logging.set_verbosity_error()
    mesh = make_mesh(1, world)
    out = {}
    for name in names:
        try:
            model = build(family(name), seed=123)  # other weights: the load must replace them
            parallelize(model, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            checkpoint.load(f"{root}/{name}/ckpt", model, opt)
            with torch.no_grad():
                out[name] = {"after": model(ids(2)[0], use_cache=False).logits}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out
