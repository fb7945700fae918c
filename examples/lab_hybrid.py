"""A lab: a GPT-style character model on the Python standard library's own sources, trained with a hybrid
(dp x pp x tp) plan read from a TOML file; the plan is printed and checked before any training starts.

    hpdl launch -n 4 examples/lab_hybrid.py                          # dp1 x pp2 x tp2 (examples/hybrid_plan.toml)
    hpdl launch -n 4 examples/lab_hybrid.py --plan my_plan.toml --steps 300
    python examples/lab_hybrid.py --plan-json '{"dp": 1}'            # one process, same code

It trains for --steps steps with `hpdl.train.Trainer` (the same loop for
every plan: a pipeline's micro-batches, tp, ZeRO over dp), prints the loss
as it falls, saves a sharded checkpoint (--save DIR), and can resume from
one written on any other mesh (--resume DIR).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Optional

import torch

import hpdl
from hpdl.models.gpt import GPT, CharCodec, GPTConfig, stdlib_text
from hpdl.parallel import Mesh, Plan, build
from hpdl.parallel.mesh.plan_config import PlanError
from hpdl.parallel.tensor import vocab_parallel_cross_entropy
from hpdl.train import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default=os.path.join(HERE, "hybrid_plan.toml"), help="plan file (.toml or .json)")
    parser.add_argument("--plan-json", help="the plan inline as JSON (instead of --plan)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="global batch of sequences")
    parser.add_argument("--block", type=int, default=64, help="characters per sequence")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--chars", type=int, default=200_000, help="characters of stdlib source to train on")
    parser.add_argument("--save", help="write a sharded checkpoint here at the end")
    parser.add_argument("--resume", help="start from a checkpoint written on any mesh")
    return parser.parse_args(argv)


def batches(ids: torch.Tensor, steps: int, batch: int, block: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the text; the same on every rank (each dp replica takes its slice)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - block - 1, (steps, batch), generator=g)
    window = starts.unsqueeze(-1) + torch.arange(block + 1)
    chunk = ids[window]
    return chunk[..., :-1], chunk[..., 1:]


def train(comm, args: argparse.Namespace) -> list[float]:
    """The whole lab on `comm`; returns the loss of every step (the same on every rank)."""
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    codec = CharCodec()
    config = GPTConfig(vocab_size=codec.vocab_size, block_size=args.block, n_layer=args.layers, n_head=4,
                       n_embd=args.embd)  # fmt: skip

    # 1. The plan: read, printed, checked against this world and this model before anything else happens.
    plan = Plan.from_dict(json.loads(args.plan_json)) if args.plan_json else Plan.from_file(args.plan)
    torch.manual_seed(0)
    model = GPT(config)
    plan = plan.validate(comm.size, model)  # PlanError with the reason if it cannot run here
    say(f"== plan ({args.plan_json or args.plan}), checked for {comm.size} ranks:\n{plan.describe()}")

    # 2. The mesh and the model: tp layers, then pipeline stages, then data parallel / ZeRO over dp.
    mesh = Mesh.from_plan(comm, plan)
    say(mesh.describe())
    model, optimizer = build(model, mesh, plan, optimizer=torch.optim.AdamW, lr=args.lr)
    # The loss never gathers the vocabulary: each tp rank holds its slice of the logits.
    loss_fn = functools.partial(vocab_parallel_cross_entropy, comm=mesh.tp)
    trainer = Trainer(model, optimizer, loss_fn, mesh=mesh)
    if args.resume:
        trainer.restore(args.resume)
        say(f"== resumed from {args.resume} at step {trainer.global_step} (written on another mesh is fine)")
    first = trainer.global_step

    # 3. Train: each dp replica reads its slice of every global batch (the same on its tp and pp ranks).
    text = stdlib_text(args.chars)
    ids = codec.encode(text)
    say(f"== data: {len(text):,} characters of Python standard-library source, vocabulary {codec.vocab_size}")
    x, y = batches(ids, first + args.steps, args.batch, args.block)
    per = args.batch // mesh.shape["dp"]
    lo = mesh.dp.rank * per
    replica = [(x[step, lo : lo + per], y[step, lo : lo + per]) for step in range(first, first + args.steps)]
    history = trainer.fit(replica, trainer.epoch + 1)  # one epoch of --steps steps (after a resume: one more)
    losses = history.losses[-args.steps :]
    for i in range(0, args.steps, max(1, args.steps // 10)):
        say(f"step {first + i:4d}  loss {losses[i]:.3f}")
    if args.save:
        trainer.save(args.save)
        say(f"== saved a sharded checkpoint to {args.save}")
    mesh.close()
    return losses


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    comm = hpdl.init()
    try:
        losses = train(comm, args)
    except PlanError as exc:
        if comm.rank == 0:
            print(f"lab_hybrid: the plan cannot run here: {exc}", file=sys.stderr)
        hpdl.finalize()
        return 2
    if comm.rank == 0:
        k = max(1, len(losses) // 10)
        print(f"== loss fell from {sum(losses[:k]) / k:.3f} to {sum(losses[-k:]) / k:.3f} (mean of first/last {k})")
    hpdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
