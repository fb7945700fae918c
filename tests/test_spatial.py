"""Spatial parallelism: P ranks, each holding a slab of every activation, train like one process on the whole image.

Tolerances: float64; spatial parallelism changes only the order of sums
(halo rows concatenated, batch-norm statistics merged, weight-gradient
shares added), so results agree with one process to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpdl.errors import NotInitializedError
from hpdl.parallel.spatial import SpatialParallel, even_split, gather, plan_windows, shard
from hpdl.parallel.spatial.cost import spatial_estimate
from hpdl.parallel.spatial.grid import coordinates, grid_shape, normalize_split
from spatial_models import make_data, make_net, train

TOL = 1e-10


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------------- one process
def test_windows_cover_the_output_and_read_the_rows_a_strided_dilated_window_needs():
    windows = plan_windows(29, 3, kernel=3, stride=2, dilation=2, pad_lo=2, pad_hi=2, mode="zeros", layer="conv")
    assert [w.own for w in windows] == even_split(29, 3) == [(0, 10), (10, 20), (20, 29)]
    assert [w.out for w in windows] == [(0, 5), (5, 10), (10, 15)]
    # rank 1: outputs 5..9 read rows 5*2-2 = 8 .. 9*2-2+4 = 20
    assert windows[1].need == (8, 21)
    assert windows[1].top == [("peer", 0, 8), ("peer", 0, 9)] and windows[1].bottom == [("peer", 2, 0)]
    assert windows[0].top == [("fill", 0, 0)] * 2
    circular = plan_windows(9, 2, kernel=3, stride=1, dilation=1, pad_lo=1, pad_hi=1, mode="circular", layer="c")
    assert circular[0].top == [("peer", 1, 3)] and circular[1].bottom == [("peer", 0, 0)]


def test_a_slab_thinner_than_the_halo_is_an_error_that_says_the_smallest_size():
    with pytest.raises(ValueError, match=r"conv7: rank 0's slab of 2 rows .* smallest slab it supports is 3 rows"):
        plan_windows(5, 4, kernel=7, stride=1, dilation=1, pad_lo=3, pad_hi=3, mode="zeros", layer="conv7")
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        plan_windows(6, 4, kernel=3, stride=2, dilation=1, pad_lo=0, pad_hi=0, mode="zeros", layer="c")


def test_an_unsupported_layer_is_named_before_any_compute(ranks):
    pool = ranks("self")
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.ReLU(), nn.LayerNorm(4)), nn.AdaptiveAvgPool2d(1))
    with pytest.raises(ValueError, match=r"layer '1\.1' \(LayerNorm\) cannot run on slabs"):
        SpatialParallel(model, pool.comm)
    # after the global pool the network runs replicated: anything goes there
    SpatialParallel(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(2)), pool.comm
    )


def test_a_grid_is_the_most_even_one_row_major_and_must_multiply_to_the_ranks():
    assert [grid_shape(n, 2) for n in (1, 2, 3, 4, 6, 8)] == [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2), (4, 2)]
    assert grid_shape(8, 3) == (2, 2, 2) and grid_shape(4, 3) == (2, 2, 1)
    assert [coordinates(r, (2, 3)) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert normalize_split((2, 3), None, 4, "x") == ((2, 3), (2, 2))
    with pytest.raises(ValueError, match=r"grid dim 2\(2\) \* dim 3\(3\) = 6 != the group's 4 ranks"):
        normalize_split((2, 3), (2, 3), 4, "SpatialParallel")
    with pytest.raises(ValueError, match="tuple of distinct ones"):
        normalize_split((2, 2), None, 4, "SpatialParallel")
    x = torch.arange(5 * 7, dtype=torch.float64).view(1, 1, 5, 7)

    class Rank:
        size, rank = 4, 3

    # rank 3 of a 2 x 2 grid: the bottom-right block, the first rows/columns to the first ranks
    assert torch.equal(shard(x, Rank(), (2, 3), (2, 2)), x[:, :, 3:, 4:])


# ---------------------------------------------------------------------- N ranks
def spatial_train(comm, nd, shape, opt_name, overlap=True):
    x, y = make_data(shape)
    model = SpatialParallel(make_net(nd), comm, dim=2, overlap=overlap)
    got = train(model, x, y, opt_name, prepare=lambda t: shard(t, comm, 2))
    start, end = even_split(shape[0], comm.size)[comm.rank]
    got["block"] = [(2, start, end)]  # (dim, start, end) of this rank's part of the input
    got["state"] = {k.removeprefix("module."): v for k, v in got["state"].items()}
    got["grads"] = {k.removeprefix("module."): v for k, v in got["grads"].items()}
    return got


def check_against_one_process(results, nd, shape, opt_name):
    x, y = make_data(shape)
    want = train(make_net(nd), x, y, opt_name)
    for rank, got in enumerate(results):
        what = f"rank {rank} of {len(results)}"
        assert close(got["logits"], want["logits"]) <= TOL, what
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= TOL, what
        block = want["input_grad"]
        for d, start, end in got["block"]:
            block = block.narrow(d, start, end - start)
        assert close(got["input_grad"], block) <= TOL, what
        for name, g in want["grads"].items():
            assert close(got["grads"][name], g) <= TOL, f"{what}: grad {name}"
        assert got["state"].keys() == want["state"].keys()
        for name, v in want["state"].items():
            assert close(got["state"][name], v) <= TOL, f"{what}: {name} after {len(got['losses'])} steps"


@pytest.mark.parametrize(
    "nprocs, nd, shape, opt_name",
    [
        (2, 2, (29, 11), "sgd"),
        (3, 2, (37, 9), "adam"),
        (4, 2, (53, 7), "sgd"),
        (2, 3, (27, 6, 5), "adam"),
        (3, 3, (29, 6, 5), "sgd"),
    ],
)
def test_spatial_training_equals_one_process_on_the_whole_image(ranks, nprocs, nd, shape, opt_name):
    results = ranks("mpi", nprocs).run(spatial_train, nd, shape, opt_name, timeout=120)
    check_against_one_process(results, nd, shape, opt_name)


def test_without_overlap_the_same_numbers(ranks):
    results = ranks("mpi", 3).run(spatial_train, 2, (37, 9), "sgd", False, timeout=120)
    check_against_one_process(results, 2, (37, 9), "sgd")


def grid_train(comm, nd, shape, dims, grid, opt_name):
    x, y = make_data(shape)
    model = SpatialParallel(make_net(nd), comm, dim=dims, grid=grid)
    got = train(model, x, y, opt_name, prepare=model.shard)
    got["block"] = [
        (d, *even_split(shape[d - 2], p)[c]) for d, p, c in zip(dims, model.grid, coordinates(comm.rank, model.grid))
    ]
    got["state"] = {k.removeprefix("module."): v for k, v in got["state"].items()}
    got["grads"] = {k.removeprefix("module."): v for k, v in got["grads"].items()}
    got["sent"] = model.halo_stats.bytes_sent
    last = len(dims) - 1  # the picture of the last axis's split, over that axis's ranks
    got["picture"] = model.describe(shape[dims[last] - 2], axis=last)
    got["grid"] = model.grid
    model.close()
    got["groups closed"] = all(_is_closed(group) for _, group in model.axes if group is not comm)
    return got


def _is_closed(group) -> bool:
    try:
        group.barrier()
    except NotInitializedError:  # what a collective on a closed communicator raises
        return True
    return False


@pytest.mark.parametrize(
    "nprocs, nd, shape, dims, grid, opt_name",
    [
        (4, 2, (29, 23), (2, 3), None, "adam"),  # 2 x 2 blocks of height x width
        (3, 2, (21, 37), (2, 3), (1, 3), "sgd"),  # columns: width split alone, through the grid
        (2, 2, (21, 27), (3, 2), None, "sgd"),  # the axes in the other order
        (4, 3, (27, 13, 12), (2, 3, 4), None, "sgd"),  # a volume on a 2 x 2 x 1 grid
    ],
)
def test_a_grid_split_over_several_dimensions_equals_one_process(ranks, nprocs, nd, shape, dims, grid, opt_name):
    """Every layer kind of make_net (strided, dilated, grouped convs with all four padding modes, pooling,
    batch norm, a global pool and head) on blocks: the corners reach the diagonal neighbours through the
    exchanges one axis after the other."""
    results = ranks("mpi", nprocs).run(grid_train, nd, shape, dims, grid, opt_name, timeout=120)
    check_against_one_process(results, nd, shape, opt_name)
    for rank, got in enumerate(results):
        what = f"rank {rank} of {nprocs}"
        assert got["sent"] > 0 and got["groups closed"], what
        last = len(dims) - 1
        picture = got["picture"]
        assert f"input: {shape[dims[last] - 2]} rows over {got['grid'][last]} ranks (grid axis {last})" in picture
        assert picture.count("  rank 0:") > 0 and f"  rank {got['grid'][last]}:" not in picture, picture


def grid_round_trip(comm):
    x = torch.arange(2 * 3 * 11 * 9, dtype=torch.float64).view(2, 3, 11, 9)
    local = shard(x, comm, (2, 3)).requires_grad_(True)
    full = gather(local, comm, (2, 3))
    weights = torch.arange(11 * 9, dtype=torch.float64).view(1, 1, 11, 9)
    (full * weights).sum().backward()
    return bool(torch.equal(full, x)), bool(torch.equal(local.grad, shard(weights.expand_as(x), comm, (2, 3))))


def test_gather_puts_a_grid_of_blocks_together_and_returns_each_rank_its_block_of_the_gradient(ranks):
    for rank, (same, grad) in enumerate(ranks("mpi", 4).run(grid_round_trip)):
        assert same and grad, rank


def gather_round_trip(comm):
    x = torch.arange(2 * 3 * 11 * 4, dtype=torch.float64).view(2, 3, 11, 4).requires_grad_(True)
    local = shard(x.detach(), comm, 2).requires_grad_(True)
    full = gather(local, comm, 2)
    (full * torch.arange(11.0, dtype=torch.float64).view(1, 1, 11, 1)).sum().backward()
    return bool(torch.equal(full, x.detach())), local.grad[0, 0, :, 0].tolist(), even_split(11, comm.size)[comm.rank]


def test_gather_puts_the_slabs_together_and_returns_each_rank_its_rows_of_the_gradient(ranks):
    for rank, (same, grad, (start, end)) in enumerate(ranks("mpi", 3).run(gather_round_trip)):
        assert same and grad == [float(i) for i in range(start, end)], rank


def activation_peaks(comm, shape):
    """Peak bytes autograd saves for backward in one step: one process on the whole image, and this rank's slab."""
    import torch.nn.functional as F

    from hpdl.parallel.pipe.memory import ActivationMeter

    x, y = make_data(shape, steps=1)
    whole = ActivationMeter()
    with whole:
        F.cross_entropy(make_net(2)(x[0]), y[0]).backward()
    model = SpatialParallel(make_net(2), comm, dim=2)
    local = shard(x[0], comm, 2)
    sliced = ActivationMeter()
    with sliced:
        F.cross_entropy(model(local), y[0]).backward()
    return whole.peak, sliced.peak, model.halo_stats.bytes_sent


def test_each_rank_keeps_about_one_pth_of_the_activations_and_sends_the_planned_halos(ranks):
    shape = (256, 32)
    planned = spatial_estimate(make_net(2), (2, 2, *shape), parts=2)
    for rank, (whole, sliced, sent) in enumerate(ranks("mpi", 2).run(activation_peaks, shape)):
        assert sliced <= 0.5 * 1.15 * whole, f"rank {rank}: {sliced} bytes of {whole} ({sliced / whole:.3f})"
        assert sent == planned.halo_bytes_forward[rank], rank
        assert planned.activation_bytes_per_rank(whole) >= 0.5 * whole
