"""The messages of hpdl.checkpoint's readers: a tensor name it does not hold says which names it does."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import hpdl
from hpdl.checkpoint import CheckpointError
from hpdl.comm.self_backend import SelfCommunicator


def _saved(path: str, model: nn.Module, optimizer=None) -> str:
    hpdl.checkpoint.save(path, model, optimizer, comm=SelfCommunicator(timeout=30.0, debug=False))
    return path


def test_an_unknown_name_lists_the_names_a_small_checkpoint_holds(tmp_path):
    torch.manual_seed(0)
    path = _saved(str(tmp_path / "ckpt"), nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    with pytest.raises(CheckpointError) as caught:
        hpdl.checkpoint.read_full_tensor(path, "fc.weight")
    message = str(caught.value)
    assert "holds no tensor 'fc.weight'" in message, message
    assert "it holds model/0.weight, model/0.bias, model/2.weight, model/2.bias" in message, message
    assert hpdl.checkpoint.read_full_tensor(path, "2.bias").shape == (2,)  # a bare name that is there is found


def test_an_unknown_name_in_a_large_checkpoint_lists_the_nearest_names(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(6)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()  # the moments: optim/<name>/exp_avg, ... (many more names than are listed)
    path = _saved(str(tmp_path / "ckpt"), model, optimizer)
    held = hpdl.checkpoint.ShardReader(path).names
    with pytest.raises(CheckpointError) as caught:
        hpdl.checkpoint.read_full_tensor(path, "4.weigth")
    message = str(caught.value)
    nearest = re.search(r"it holds (\d+) tensors, the nearest: (.*) \(all: ShardReader\(folder\).names\)", message)
    assert nearest and int(nearest.group(1)) == len(held) > 8, message
    names = nearest.group(2).split(", ")
    assert names[0] == "model/4.weight" and len(names) == 5 and set(names) <= set(held), message
