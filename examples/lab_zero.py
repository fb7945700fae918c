"""Lab: train a model that does not fit one rank's memory budget with ZeRO stage 3, then reshard its checkpoint.

    hpdl launch -n 2 examples/lab_zero.py [--budget-mb 16] [--epochs 4] [--out DIR]

The budget is the memory one rank may spend on model state (parameters,
gradients, optimizer state). The model (64-1024-1024-10 on scikit-learn's
digits, 1.1 M parameters) needs 16 bytes per parameter with Adam in one
process, more than the budget; stage 3 on 2 ranks needs 16/N bytes per
parameter plus the largest gathered units. The lab checks that each claim
holds on this run (and stops with an error if not):

1. the ZeRO formula says one process does not fit and stage 3 does;
2. the measured model state of each rank (tensor storages) fits the budget;
3. training reaches the stated test accuracy;
4. the sharded checkpoint loads into stage 1 on the same ranks and into one
   plain process (a different rank count and strategy, no conversion) and
   gives the same predictions; the consolidated export does too.

The checkpoint goes to a temporary folder, removed at the end (--out DIR:
to DIR instead, kept).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
from sklearn.datasets import load_digits
from torch import nn

import hpdl
from hpdl.parallel.zero_redundancy import memory_formula, zero


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def say(comm: hpdl.Communicator, text: str) -> None:
    print(f"[rank {comm.rank}] {text}", flush=True)


def check(claim: bool, text: str) -> None:
    if not claim:
        raise SystemExit(f"lab_zero: claim failed: {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=16.0, help="model-state memory per rank (MB)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", help="checkpoint folder, kept (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    comm = hpdl.init()
    keep = args.out is not None
    if not keep:  # one folder for every rank: rank 0 makes it
        args.out = comm.broadcast_object(tempfile.mkdtemp(prefix="hpdl-lab-zero-") if comm.rank == 0 else None)
    budget = args.budget_mb * 1e6
    numel = sum(p.numel() for p in build().parameters())
    largest_units = 4 * ((64 + 1) * 1024 + (1024 + 1) * 1024)  # in backward: a unit and its prefetched neighbour
    alone = memory_formula(0, numel, 1)["total"]
    sharded = memory_formula(3, numel, comm.size, gathered_bytes=largest_units)["total"]
    say(
        comm,
        f"{numel} parameters: one process needs {alone / 1e6:.1f} MB, stage 3 on {comm.size} ranks "
        f"{sharded / 1e6:.1f} MB; budget {args.budget_mb} MB per rank",
    )
    check(alone > budget >= sharded or comm.size == 1, "the budget separates one process from stage 3")

    # 1. train with stage 3 (each rank its shard of every batch)
    model, opt = zero(build(), comm, stage=3, optimizer=torch.optim.AdamW, lr=1e-3, wrap_policy=(nn.Linear,))
    x, y, x_test, y_test = data()
    per = 64 // comm.size
    for _epoch in range(args.epochs):
        for start in range(0, len(y) - 63, 64):
            lo = start + comm.rank * per
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[lo : lo + per]), y[lo : lo + per]).backward()
            opt.step()
    with torch.no_grad():
        predictions = model(x_test).argmax(1)
    accuracy = float((predictions == y_test).float().mean())
    peak = opt.model_state_bytes()["total"] + model.peak_gathered_bytes  # shards + the most units gathered at once
    say(
        comm,
        f"model state {opt.model_state_bytes()['total'] / 1e6:.2f} MB, with the gathered units at their peak "
        f"{peak / 1e6:.2f} MB (fits the budget: {peak <= budget})",
    )
    say(comm, f"stage 3 test accuracy {accuracy:.3f}")
    check(peak <= budget, "the measured model state fits the budget")
    check(accuracy >= 0.9, "stage 3 reaches 0.9 test accuracy")

    # 2. save sharded; load into stage 1 on the same ranks, and into one plain process
    hpdl.checkpoint.save(args.out, model, opt, extra={"epochs": args.epochs})
    model1, opt1 = zero(build(), comm, stage=1, optimizer=torch.optim.AdamW, lr=1e-3)
    hpdl.checkpoint.load(args.out, model1, opt1)
    with torch.no_grad():
        same_stage1 = bool(torch.equal(model1(x_test).argmax(1), predictions))
    say(comm, f"stage 3 -> stage 1 on {comm.size} ranks: same predictions (same: {same_stage1})")
    check(same_stage1, "stage 1 predicts as stage 3 did")
    if comm.rank == 0:  # one process, no communicator: a plain nn.Module and a plain AdamW
        plain = build()
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        extra = hpdl.checkpoint.load(args.out, plain, plain_opt)
        with torch.no_grad():
            same_plain = bool(torch.equal(plain(x_test).argmax(1), predictions))
        exported = os.path.join(args.out, "consolidated.pt")
        hpdl.checkpoint.export(args.out, exported)
        served = build()
        served.load_state_dict(torch.load(exported, weights_only=True))
        with torch.no_grad():
            same_export = bool(torch.equal(served(x_test).argmax(1), predictions))
        say(
            comm,
            f"stage 3 on {comm.size} ranks -> one plain process (epochs {extra['epochs']}): "
            f"same predictions (same: {same_plain}); consolidated export (same: {same_export})",
        )
        check(same_plain and same_export, "one process predicts as stage 3 did")
    comm.barrier()
    if comm.rank == 0 and not keep:
        shutil.rmtree(args.out)
    hpdl.finalize()


if __name__ == "__main__":
    main()
