"""Train a small CNN on scikit-learn's digits with data parallelism: `hpdl demo` as a plain script.

    hpdl launch -n 2 examples/train_digits.py [--epochs 12]

Every rank runs this same script: it reads its shard of the data through
DistributedSampler, DataParallel averages the gradients as backward
returns, and Trainer runs the epochs (progress bar on rank 0).
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import hpdl
from hpdl.parallel import DataParallel
from hpdl.train import DistributedSampler, Trainer, WarmupSchedule
from hpdl.train.demo import build_model, load_digits_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--checkpoint", default=None, help="checkpoint file (resumed from when it exists)")
    args = parser.parse_args()

    comm = hpdl.init()
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = load_digits_split(seed=0)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, comm))
    test_loader = DataLoader(test_set, batch_size=256, sampler=DistributedSampler(test_set, comm, pad=False))

    model = DataParallel(build_model(), comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    scheduler = WarmupSchedule.for_scaling(  # lr 0.05 suits 32 samples a step: scale it to the global batch
        optimizer,
        global_batch=args.batch_size * comm.size,
        reference_batch=32,
        warmup_steps=len(train_loader),
        total_steps=args.epochs * len(train_loader),
        decay="cosine",
    )
    trainer = Trainer(model, optimizer, comm=comm, scheduler=scheduler, checkpoint=args.checkpoint)
    history = trainer.fit(train_loader, args.epochs, eval_loader=test_loader, resume="auto")
    if comm.rank == 0:
        last = history.epochs[-1]
        print(f"test accuracy {last['eval_accuracy']:.4f}, {last['samples_per_s']:,.0f} samples/s in the last epoch")
    hpdl.finalize()


if __name__ == "__main__":
    main()
