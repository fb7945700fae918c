"""The rank side of `hpdl train`: a plan file, a model factory and a data loader trained by the `Trainer`.

    hpdl train -n 4 --model mypkg.models:make_gpt --data mypkg.data:loader --plan plan.toml --epochs 3

Every rank reads the plan (`hpdl plan --out plan.toml` writes one), checks it
against the world and the model, builds the mesh and the model on it, and
calls `loader(rank=, size=)` with its data-parallel replica and the replica
count: the loader returns that replica's batches ((inputs, targets) pairs),
the same on every rank of the replica. `hpdl.cli.train` starts the ranks
(`-n`, `--max-restarts`) or runs this in the current process.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Callable, Optional, Sequence

__all__ = ["build_parser", "main", "load_callable", "LAUNCH_OPTIONS"]

LAUNCH_OPTIONS = ("-n", "--max-restarts", "--backend")
"""Options `hpdl train` hands to `hpdl launch` (the ranks never see them)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpdl train",
        description="Train a model with a plan file (hpdl plan --out plan.toml) and no code of your own: a model "
        "factory and a data loader, each named package.module:function or path/to/file.py:function.",
    )
    parser.add_argument("--model", required=True, metavar="MOD:FACTORY", help="returns the plain nn.Module")
    parser.add_argument(
        "--data",
        required=True,
        metavar="MOD:LOADER",
        help="called as loader(rank=, size=) with this rank's data-parallel replica and the replica count; "
        "returns an iterable of (inputs, targets) batches, the same on every rank of a replica",
    )
    parser.add_argument("--plan", required=True, help="plan file (.toml or .json), as hpdl plan --out writes")
    parser.add_argument("--eval-data", metavar="MOD:LOADER", help="a loader like --data, evaluated every epoch")
    parser.add_argument("--loss", metavar="MOD:FN", help="loss_fn(output, target) (default: cross entropy)")
    parser.add_argument("--epochs", type=_positive(int), default=1, help="epochs (default 1)")
    parser.add_argument("--optimizer", default="AdamW", help="a torch.optim class (default AdamW)")
    parser.add_argument("--lr", type=_positive(float), default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--momentum", type=float, help="the optimizer's momentum (SGD, RMSprop)")
    parser.add_argument("--weight-decay", type=float, help="the optimizer's weight decay")
    parser.add_argument("--max-grad-norm", type=_positive(float), help="clip gradients by their global norm")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--checkpoint", metavar="DIR", help="sharded checkpoint folder, written every epoch")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS", help="and every STEPS steps")
    parser.add_argument("--resume", metavar="DIR", help="start from this checkpoint folder ('auto': --checkpoint)")
    parser.add_argument("--history", metavar="FILE", help="write the losses and epoch records as JSON (rank 0)")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed before the factory runs (default 0)")
    launching = parser.add_argument_group("launching (hpdl train hands these to hpdl launch)")
    launching.add_argument("-n", dest="ranks", type=_positive(int), help="start N local ranks")
    launching.add_argument("--max-restarts", type=int, help="start a failed job again; it resumes --checkpoint")
    launching.add_argument("--backend", choices=("mpi", "torch"), help="the ranks' backend (default mpi)")
    return parser


def _positive(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value

    return convert


def load_callable(spec: str, option: str) -> Callable[..., Any]:
    """`package.module:name` or `path/to/file.py:name` -> the callable, with an error that names `option`."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"{option} {spec!r}: write package.module:function or path/to/file.py:function")
    if target.endswith(".py") or os.sep in target:
        if not os.path.exists(target):
            raise ValueError(f"{option} {spec!r}: file {target!r} does not exist")
        found = importlib.util.spec_from_file_location(f"_hpdl_train_{abs(hash(os.path.abspath(target)))}", target)
        if found is None or found.loader is None:
            raise ValueError(f"{option} {spec!r}: cannot import {target!r}")
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"{option} {spec!r}: cannot import {target!r} ({exc}); is it on PYTHONPATH?") from None
    value = getattr(module, attr, None)
    if not callable(value):
        raise ValueError(f"{option} {spec!r}: {target!r} has no callable {attr!r}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Every rank: train the plan; 2 for a plan or a name that cannot be used here (said on rank 0)."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    import hpdl
    from hpdl.parallel.mesh import Plan, PlanError
    from hpdl.train.trainer import Trainer

    started = not hpdl.is_initialized()  # a program that already started hpdl keeps its world
    comm = hpdl.init()
    try:
        optimizer = getattr(torch.optim, args.optimizer, None)
        if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
            raise ValueError(f"--optimizer {args.optimizer!r} is not a torch.optim optimizer (SGD, Adam, AdamW, ...)")
        options = {"lr": args.lr}
        options.update({k: v for k, v in (("momentum", args.momentum), ("weight_decay", args.weight_decay)) if v})
        plan = Plan.from_file(args.plan)
        loss = load_callable(args.loss, "--loss") if args.loss else None
        torch.manual_seed(args.seed)
        model = load_callable(args.model, "--model")()
        trainer = Trainer.from_plan(
            model, plan, comm, optimizer=optimizer, optimizer_options=options, loss_fn=loss,
            max_grad_norm=args.max_grad_norm, precision=args.precision, checkpoint=args.checkpoint,
            checkpoint_every=args.checkpoint_every,
        )  # fmt: skip
        assert trainer.layout is not None
        mesh = trainer.layout.mesh
        data = load_callable(args.data, "--data")(rank=mesh.dp.rank, size=mesh.dp.size)
        evaluation = None
        if args.eval_data:
            evaluation = load_callable(args.eval_data, "--eval-data")(rank=mesh.dp.rank, size=mesh.dp.size)
    except (PlanError, ValueError) as exc:
        if comm.rank == 0:
            print(f"hpdl train: {exc}", file=sys.stderr)
        if started:
            hpdl.finalize()
        return 2
    if comm.rank == 0:
        print(f"hpdl train: {args.plan} on {comm.size} ranks\n{trainer.layout.mesh.describe()}", flush=True)
    history = trainer.fit(data, args.epochs, eval_loader=evaluation, resume=args.resume)
    if comm.rank == 0 and args.history:
        with open(args.history, "w") as out:
            json.dump(history.state(), out, indent=1)
    mesh.close()
    if started:
        hpdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
