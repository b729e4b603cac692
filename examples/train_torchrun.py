"""Train an unmodified model with autopar under torchrun: a plain PyTorch training loop.

Run it on this machine's CPU, one gloo process per device of the mesh::

    torchrun --standalone --nproc-per-node 4 examples/train_torchrun.py               # HF GPT-2 (tiny), 2x2
    torchrun --standalone --nproc-per-node 2 examples/train_torchrun.py --mesh 2 --model llama-tiny

Every rank runs this file: it joins the process group, forms the device mesh, builds the model as
its author builds it (a zoo entry: Hugging Face's ``from_config``, or the hand-written GPT), and
calls ``autopar.compile``, which plans on rank 0, shares the plan and returns the sharded module.
The loop is the one a single device runs: every rank passes the same global batch. At the end
``autopar.save`` writes a checkpoint of the model and the optimizer (``autopar.load`` reads it
back into any plan or mesh shape of the same model).

The first compile on a host measures it (its collectives, the runtime's overheads and the model's
ops, cached under ``~/.cache/autopar/profiles``); ``AUTOPAR_MEASURE_FIRST_PROFILE=0`` skips that
and plans on the CPU roofline.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.cli import parse_mesh
from autopar.core.mesh import default_axis_names
from autopar.models.zoo import get_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-tiny", help="zoo model (`autopar models`), default gpt2-tiny")
    p.add_argument("--mesh", default="2x2", help="mesh shape, its size the number of processes (default 2x2)")
    p.add_argument("--batch", type=int, default=16, help="global batch: rows every rank passes (default 16)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint", default="checkpoints/train_torchrun", help="directory autopar.save writes")
    return p.parse_args()


def random_batch(example: tuple[tuple, dict], step: int) -> tuple[tuple, dict]:
    """A batch shaped as ``example`` with new token ids (the same on every rank: seeded by the
    step). Stands in for a data loader: each rank passes the whole global batch."""
    gen = torch.Generator().manual_seed(step)

    def fresh(v):
        if isinstance(v, torch.Tensor) and v.dtype == torch.long:
            return torch.randint(0, int(v.max()) + 1, v.shape, generator=gen)
        if isinstance(v, torch.Tensor) and v.is_floating_point():   # pixels
            return torch.randn(v.shape, generator=gen, dtype=v.dtype)
        return v

    args, kwargs = example
    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


def loss_of(out) -> torch.Tensor:
    """The loss a model returns: a tensor (the hand-written GPT) or a Hugging Face output's ``.loss``."""
    return out if isinstance(out, torch.Tensor) else out.loss


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)   # the ranks share this host's cores
    shape = parse_mesh(args.mesh)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=default_axis_names(len(shape)))
    rank = dist.get_rank()

    entry = get_model(args.model)
    torch.manual_seed(0)       # the same initial weights on every rank
    model = entry.build()      # unmodified: what the model's author builds
    example = entry.example(args.batch, args.seq)
    pmodel = autopar.compile(model, mesh, *example)   # plans (rank 0), shares the plan, shards the weights
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr, foreach=True)

    for step in range(args.steps):
        batch_args, batch_kwargs = random_batch(example, step)
        loss = loss_of(pmodel(*batch_args, **batch_kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    autopar.save(pmodel, opt, args.checkpoint)   # every rank writes its shards
    if rank == 0:
        print(f"checkpoint saved to {os.path.abspath(args.checkpoint)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
