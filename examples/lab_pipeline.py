"""A lab: pipeline parallelism on a small character-level transformer, trained on Python's own sources.

    hpdl launch -n 2 examples/lab_pipeline.py           (or -n 3, 4; --backend torch; --steps 300)

The model is a list of layer factories, so each rank builds only its own
stage's layers; the text is the standard library's .py files. Each part
prints what every rank holds and checks the claim it makes.
"""

import argparse
import math
import os
import sysconfig

import torch
from torch import nn

import hpdl
from hpdl.parallel import Pipeline

SEQ, D, HEADS, BLOCKS = 64, 96, 4, 4


def show(comm, title: str, line: str) -> None:
    """Gather one line from every rank and print them under a title on rank 0."""
    lines = comm.allgather_object(line)
    if comm.rank == 0:
        print(f"\n== {title}")
        for rank, text in enumerate(lines):
            print(f"   rank {rank}: {text}")


def stdlib_text(limit: int = 400_000) -> str:
    """The first `limit` characters of the standard library's .py files, in a fixed order (ASCII only)."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="ignore") as handle:
                text = handle.read().encode("ascii", "ignore").decode()
            parts.append(text)
            total += len(text)
            if total >= limit:
                break
    return "".join(parts)[:limit]


class Embed(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Parameter(torch.randn(SEQ, D) * 0.02)

    def forward(self, x):
        return self.tok(x) + self.pos[: x.shape[1]]


class Block(nn.Module):
    """One pre-norm causal transformer block: an ordinary module, exactly as in one process."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        return self.layer(x, src_mask=self.mask[:t, :t], is_causal=True)


def factories(vocab: int) -> list:
    """The model as layer factories: a rank calls only those of its own stage."""
    head = lambda: nn.Sequential(nn.LayerNorm(D), nn.Linear(D, vocab))  # noqa: E731
    return [lambda: Embed(vocab), *[Block for _ in range(BLOCKS)], head]


def next_char_loss(out, target):
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = hpdl.init()
    if comm.rank == 0:
        print(f"{comm.size} ranks over {comm.backend} ({comm.engine}): a {comm.size}-stage pipeline.")

    # 1. The data: every rank reads the same text (stage 0 needs the inputs, the last stage the targets).
    text = stdlib_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    show(comm, "1. Python's standard library as training text", f"{len(text)} characters, {len(chars)} distinct")

    # 2. The model, cut into stages: each rank builds only its layers (seeded per layer, so the
    #    weights do not depend on which rank builds them).
    pipe = Pipeline(factories(len(chars)), comm, chunks=args.chunks, schedule="1f1b", checkpoint="except_last",
                    seed=0)  # fmt: skip
    params = sum(p.numel() for p in pipe.parameters())
    show(comm, "2. Pipeline(factories, comm, balance=None): equal layer counts per stage",
         f"layers {pipe.first_layer}..{pipe.first_layer + len(pipe.layers) - 1} "
         f"({', '.join(type(m).__name__ for m in pipe.layers)}), {params} parameters")  # fmt: skip

    # 3. The schedule every rank follows, printed from the object the engine runs.
    if comm.rank == 0:
        print("\n== 3. The 1F1B schedule of one step (F = forward, B = backward of micro-batch k)")
        print(pipe.schedule().draw())

    # 4. Training: x only on the first stage, y only on the last; the mean loss comes back everywhere.
    optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (args.batch,), generator=g)
        window = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
        x, y = window[:, :-1], window[:, 1:]
        optimizer.zero_grad()
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, next_char_loss)
        optimizer.step()
        losses.append(float(loss))
        if comm.rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"   step {step:4d}  loss {float(loss):.3f}  (uniform guess: {math.log(len(chars)):.3f})")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    agree = comm.allgather_object(losses[-1])
    fell, same = last < 0.8 * first, len(set(agree)) == 1
    show(comm, "4. The loss fell, and every stage reports the same mean loss",
         f"loss {first:.3f} -> {last:.3f} (fell: {fell}); same on every rank: {same}")  # fmt: skip
    assert fell and same

    # 5. What each stage held: 1F1B keeps at most p - stage micro-batches in flight.
    promised, peak = pipe.schedule().peak_live(pipe.stage), pipe.stats.peak_live
    show(comm, "5. Live micro-batches per stage (counted in the engine) vs the schedule's promise",
         f"peak {peak} <= {promised} <= stages {comm.size}: {peak <= promised <= comm.size}; "
         f"busy {1 - pipe.stats.bubble:.0%} of the last step")  # fmt: skip
    assert pipe.stats.peak_live <= promised <= comm.size

    # 6. Inference through the pipeline: predict() returns the output on the last stage.
    pipe.eval()
    context = data[:SEQ].clone()
    generated = []
    for _ in range(40):
        out = pipe.predict(context[None, :] if pipe.is_first else None)
        token = torch.zeros(1, dtype=torch.long)
        if pipe.is_last:
            token[0] = int(out[0, -1].argmax())
        comm.broadcast(token, root=comm.size - 1)  # the last stage tells the first which character came next
        generated.append(chars[int(token)])
        context = torch.cat([context[1:], token])
    if comm.rank == 0:
        print("\n== 6. Greedy continuation of the first 64 characters of the text")
        print("   " + repr(text[:SEQ]) + "\n-> " + repr("".join(generated)))
    hpdl.finalize()


if __name__ == "__main__":
    main()
