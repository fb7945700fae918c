"""hpdl's pool of communication buffers (what an hpdl group's `allocate_tensor` hands FSDP2), in one process."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from hpdl.interop.torch_backend.buffer_pool import IDLE_REQUESTS, LEND_AT_MOST, BufferPool, size_class
from hpdl.interop.torch_backend.process_group import BackendCapabilities

MIB = 2**20


def test_a_freed_buffer_is_handed_out_again():
    pool = BufferPool(64 * MIB)
    first = pool.allocate(MIB // 4, torch.float32)
    address = first.data_ptr()
    del first
    second = pool.allocate(MIB // 4, torch.float32)
    assert second.data_ptr() == address
    assert (pool.made, pool.reused) == (1, 1)


def test_a_buffer_in_use_is_never_handed_out_twice():
    pool = BufferPool(64 * MIB)
    first = pool.allocate(MIB, torch.float32)
    view = first[10:20]  # a view keeps the buffer in use after the tensor itself is gone
    address = first.data_ptr()
    del first
    second = pool.allocate(MIB, torch.float32)
    assert second.data_ptr() != address
    view.fill_(1.0)
    second.fill_(2.0)
    assert bool((view == 1.0).all())
    del view
    assert pool.allocate(MIB, torch.float32).data_ptr() == address


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_the_tensor_has_the_asked_size_and_dtype_and_holds_values(dtype):
    pool = BufferPool(64 * MIB)
    numel = 3 * MIB // dtype.itemsize + 5
    t = pool.allocate(numel, dtype)
    assert (t.shape, t.dtype, t.device.type) == ((numel,), dtype, "cpu")
    assert t.is_contiguous()
    values = torch.arange(numel, dtype=torch.float64).remainder(97).to(dtype)
    t.copy_(values)
    assert torch.equal(t, values)


def test_nearby_sizes_share_a_class_and_the_class_is_at_most_an_eighth_larger():
    for nbytes in (MIB, 3 * MIB + 1, 12_845_056, 64 * MIB, 64 * MIB + 16_384, 1_000_000_007):
        assert nbytes <= size_class(nbytes) <= nbytes * 1.125
    assert size_class(64 * MIB + 16_384) == size_class(64 * MIB + 8_192)
    pool = BufferPool(256 * MIB)
    t = pool.allocate(16 * MIB + 4096, torch.float32)
    address = t.data_ptr()
    del t
    assert pool.allocate(16 * MIB + 1024, torch.float32).data_ptr() == address


def test_small_requests_and_a_pool_of_zero_bytes_leave_the_memory_to_torch():
    pool = BufferPool(64 * MIB)
    pool.allocate(1000, torch.float32)
    off = BufferPool(0)
    off.allocate(4 * MIB, torch.float32)
    assert (pool.made, pool.reused, off.made, off.reused) == (0, 0, 0, 0)
    assert not off.enabled


def test_the_pool_keeps_no_more_than_its_limit():
    pool = BufferPool(5 * MIB)
    held = [pool.allocate(MIB, torch.float32) for _ in range(3)]  # 4 MiB each
    del held
    gc.collect()
    assert pool.held_bytes == 4 * MIB  # the second and third did not fit under 5 MiB


def test_a_smaller_request_takes_a_waiting_larger_buffer_and_gives_it_back_to_its_class():
    pool = BufferPool(256 * MIB)
    large = pool.allocate(16 * MIB, torch.float32)  # a 64 MiB class
    address = large.data_ptr()
    del large
    small = pool.allocate(16 * MIB // LEND_AT_MOST, torch.float32)  # no buffer of its class waits
    assert small.data_ptr() == address and (pool.made, pool.reused, pool.held_bytes) == (1, 1, 0)
    assert pool.lent_beyond_bytes == 64 * MIB - 64 * MIB // LEND_AT_MOST  # what it keeps beyond its own class
    del small
    assert (pool.held_bytes, pool.lent_beyond_bytes) == (64 * MIB, 0)
    assert pool.allocate(16 * MIB, torch.float32).data_ptr() == address


def test_a_buffer_more_than_the_lending_bound_larger_is_not_lent():
    pool = BufferPool(256 * MIB)
    large = pool.allocate(16 * MIB, torch.float32)
    del large
    small = pool.allocate(16 * MIB // LEND_AT_MOST - MIB, torch.float32)  # its class times the bound < 64 MiB
    assert pool.made == 2 and pool.lent_beyond_bytes == 0
    del small


def test_a_request_that_makes_a_new_buffer_lets_the_smaller_waiting_ones_go():
    pool = BufferPool(256 * MIB)
    small = pool.allocate(MIB, torch.float32)
    del small
    assert pool.held_bytes == 4 * MIB
    large = pool.allocate(16 * MIB, torch.float32)  # cannot use the 4 MiB one: made, and the small one let go
    assert (pool.made, pool.held_bytes) == (2, 0)
    del large
    assert pool.held_bytes == 64 * MIB


def test_a_class_nobody_asks_for_again_is_let_go():
    pool = BufferPool(256 * MIB)
    large, idle = pool.allocate(16 * MIB, torch.float32), pool.allocate(8 * MIB, torch.float32)
    del large, idle
    assert pool.held_bytes == 96 * MIB
    for _ in range(IDLE_REQUESTS + 1):
        pool.allocate(16 * MIB, torch.float32)  # served by the waiting 64 MiB buffer, given back at once...
    assert pool.held_bytes == 64 * MIB  # ...while the 32 MiB class, not asked for, was let go
    assert pool.made == 2


def test_buffers_freed_on_other_threads_come_back_safely():
    pool = BufferPool(1024 * MIB)
    tensors = [pool.allocate(MIB // 2, torch.float32) for _ in range(8)]

    def drop(mine: list) -> None:
        mine.clear()

    threads = [threading.Thread(target=drop, args=(tensors[i::4],)) for i in range(4)]
    del tensors
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    assert pool.held_bytes == 8 * 2 * MIB
    again = [pool.allocate(MIB // 2, torch.float32) for _ in range(8)]
    assert len({t.data_ptr() for t in again}) == 8 and (pool.made, pool.reused) == (8, 8)


def test_an_hpdl_group_offers_its_pool_for_cpu_tensors_only():
    capabilities = BackendCapabilities()
    assert capabilities.supports_tensor_alloc(torch.device("cpu"))
    assert not capabilities.supports_tensor_alloc(torch.device("meta"))
    t = capabilities.allocate_tensor(MIB, dtype=torch.float32, device=torch.device("cpu"))
    assert t.shape == (MIB,)


def test_clear_lets_the_waiting_buffers_go_and_those_that_come_back_after_it():
    pool = BufferPool(256 * MIB)
    waiting, out = pool.allocate(MIB, torch.float32), pool.allocate(MIB, torch.float32)
    del waiting
    assert pool.held_bytes == 4 * MIB
    pool.clear()
    assert pool.held_bytes == 0
    del out
    assert pool.held_bytes == 0  # given back after clear(): let go too
    again = pool.allocate(MIB, torch.float32)  # a new request opens the pool again
    del again
    assert pool.held_bytes == 4 * MIB


def test_a_buffer_freed_while_this_thread_holds_the_pools_lock_does_not_deadlock():
    """The garbage collector may free a pooled tensor (in a reference cycle) inside the pool's own locked section,
    on the same thread: giving it back must not take the lock."""
    pool = BufferPool(256 * MIB)

    def free_under_the_lock() -> None:
        cycle: list = [pool.allocate(MIB, torch.float32)]
        cycle.append(cycle)  # only the cyclic collector frees it
        del cycle
        with pool._lock:
            gc.collect()

    thread = threading.Thread(target=free_under_the_lock, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the buffer's return waited for the lock its own thread held"
    assert pool.held_bytes == 4 * MIB
