"""A lab: data parallelism, shown step by step on a real run.

    hpdl launch -n 2 examples/lab_data_parallel.py      (or -n 3, 4; --backend torch)

Each step prints what every rank holds (rank 0 prints the lines of all
ranks, in order) and checks the claim it makes, so the lab fails loudly if
data parallelism ever stops working as explained.
"""

import torch

import hpdl
from hpdl.parallel import DataParallel
from hpdl.train import DistributedSampler

N_SAMPLES, BATCH = 24, 4  # per-rank batch; the global batch is BATCH * ranks


def show(comm, title: str, line: str) -> None:
    """Gather one line from every rank and print them under a title on rank 0."""
    lines = comm.allgather_object(line)
    if comm.rank == 0:
        print(f"\n== {title}")
        for rank, text in enumerate(lines):
            print(f"   rank {rank}: {text}")


def checksum(tensors) -> float:
    return float(sum((t.detach().double() * (i + 1)).sum() for i, t in enumerate(tensors)))


def main() -> None:
    comm = hpdl.init()
    if comm.rank == 0:
        print(f"{comm.size} ranks over {comm.backend} ({comm.engine}). Every rank runs this same script.")

    # 1. The data: one data set, a different shard per rank.
    g = torch.Generator().manual_seed(0)
    x_all, y_all = torch.randn(N_SAMPLES, 5, generator=g), torch.randint(0, 3, (N_SAMPLES,), generator=g)
    sampler = DistributedSampler(N_SAMPLES, comm, seed=0)
    shard = sampler.shard()
    show(comm, "1. DistributedSampler gives each rank its own samples (same permutation, every size-th index)",
         f"samples {shard}")  # fmt: skip
    index = shard[:BATCH]
    x, y = x_all[index], y_all[index]

    # 2. The model: every rank builds it with a different seed; DataParallel broadcasts rank 0's weights.
    torch.manual_seed(100 + comm.rank)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    show(
        comm,
        "2a. Before wrapping, the freshly built models differ",
        f"weights checksum {checksum(net.parameters()):+.6f}",
    )
    model = DataParallel(net, comm)
    show(comm, "2b. After DataParallel(model, comm): rank 0's weights everywhere",
         f"weights checksum {checksum(model.parameters()):+.6f}")  # fmt: skip

    # 3. Local gradients differ: each rank saw other samples. no_sync() skips the allreduce.
    loss_fn = torch.nn.functional.cross_entropy
    with model.no_sync():
        local_loss = loss_fn(model(x), y)
        local_loss.backward()
    local = [p.grad.clone() for p in model.parameters()]
    loss_value = float(local_loss.detach())
    show(comm, "3. Gradients of each rank's own batch (no_sync: not communicated)",
         f"loss {loss_value:.4f} on {BATCH} samples, gradient checksum {checksum(local):+.6f}")  # fmt: skip

    # 4. With the allreduce: when backward returns, every rank holds the mean gradient.
    model.zero_grad()
    loss_fn(model(x), y).backward()
    averaged = [p.grad.clone() for p in model.parameters()]
    mean_of_local = [comm.allreduce(t.clone(), op="avg") for t in local]
    ok = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(averaged, mean_of_local))
    show(comm, "4. A normal backward: DataParallel allreduces the gradients in buckets as they are produced",
         f"gradient checksum {checksum(averaged):+.6f}  (equal to the mean of the local ones: {ok})")  # fmt: skip
    assert ok

    # 5. Why it is correct: the mean gradient of N batches of b = the gradient of one batch of N*b.
    x_global = comm.allgather(x)
    y_global = comm.allgather(y)
    reference = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference.load_state_dict(net.state_dict())
    loss_fn(reference(x_global), y_global).backward()
    same = all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(averaged, reference.parameters()))
    show(comm, f"5. One process on the whole global batch of {BATCH * comm.size} samples gets the same gradient",
         f"gradient checksum {checksum([p.grad for p in reference.parameters()]):+.6f}  (same: {same})")  # fmt: skip
    assert same

    # 6. Same weights + same gradient + same optimizer = same weights after the step, with no weight traffic.
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    show(comm, "6. After optimizer.step() the replicas still agree (only gradients ever crossed the wire)",
         f"weights checksum {checksum(model.parameters()):+.6f}")  # fmt: skip
    if comm.rank == 0:
        layout = model.buckets
        print(f"\nThe gradients travelled in {len(layout)} bucket(s): {layout}")
        print(
            "Scale the learning rate with the global batch (hpdl.train.linear_scaled_lr) and warm up (docs/train.md)."
        )
    hpdl.finalize()


if __name__ == "__main__":
    main()
