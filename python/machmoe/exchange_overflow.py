"""Overflow reports of the capacity-bounded expert-parallel exchanges, shared by the fixed-block
all-to-all (machmoe.expert_capacity_exchange) and the all-gather exchange's pair capacity
(machmoe.expert_exchange).

A capacity is a size fixed on the host, so that nothing waits for the device. When a batch needs
more than it, nothing past it is written, every rank's output of that call is made NaN (the ranks
agree through a one-int all-reduce on the device), and the count goes into a report that
`check_capacity()` reads: it waits for the device and raises on every rank, since every rank saw
the same worst count. On the CPU the count is known at once, and the call itself raises, on every
rank, before anything is exchanged.

Inside a CUDA-graph capture no event is recorded or queried and no pinned copy is made (the host
cannot wait on work that only a replay runs): the report is a device tensor that every replay
rewrites, and check_capacity reads such reports after waiting for the whole device.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# Reports of calls whose flag may not have reached the host yet: (event or None, pinned [2] int64
# host tensor (worst count, capacity), what the capacity bounds).
_pending: list[tuple[Optional[torch.cuda.Event], torch.Tensor, str]] = []
# Reports written by CUDA-graph replays: ([2] int64 device tensor (worst count, capacity), what the
# capacity bounds); a report read by check_capacity is marked read (count -1) until a replay
# writes it again.
_captured: list[tuple[torch.Tensor, tuple]] = []

ROWS_PER_PEER = ("rows to send to one peer", "ceil(capacity_factor · max_tokens)",
                 "Raise capacity_factor (1.0 never overflows) or max_tokens.")
PAIRS_PER_RANK = ("(token, expert) pairs for its experts", "ceil(capacity_factor · W · max_tokens · K)",
                  "Raise capacity_factor (1.0 never overflows).")


def overflow_error(count: int, capacity: int, what: tuple = ROWS_PER_PEER) -> RuntimeError:
    noun, formula, fix = what
    return RuntimeError(
        f"expert-parallel exchange overflow: a rank had {count} {noun}, more than its capacity of "
        f"{capacity} ({formula}); that call's output was NaN. {fix}")


def check_capacity() -> None:
    """Raises the overflow error of an earlier capacity-bounded exchange of this process, if one
    overflowed, after waiting for those calls to finish on the device. Call it where the host
    waits anyway (reading the loss, the end of a step); every rank of a group sees the same
    overflows, so all of them raise together."""
    pending, _pending[:] = list(_pending), []
    for event, flag, what in pending:
        if event is not None:
            event.synchronize()
        if int(flag[0]) > int(flag[1]):
            raise overflow_error(int(flag[0]), int(flag[1]), what)
    if _captured:
        torch.cuda.synchronize()
        worst = None
        for report, what in _captured:
            count, capacity = report.tolist()
            if count > capacity and worst is None:
                worst = (count, capacity, what)
            report[0] = -1
        if worst is not None:
            raise overflow_error(*worst)


def forget_finished() -> None:
    """Drops the reports of calls that finished without overflowing (a non-blocking look), so
    that the list does not grow when check_capacity is not called. Raises nothing: ranks may see
    their calls finish at different times, and a rank raising alone before a collective would
    leave the others waiting in it. Does nothing inside a CUDA-graph capture (no event query
    there)."""
    if _capturing():
        return
    _pending[:] = [(event, flag, what) for event, flag, what in _pending
                   if event is not None and (not event.query() or int(flag[0]) > int(flag[1]))]


def agreed_overflow(count: torch.Tensor, capacity: int, group, what: tuple) -> torch.Tensor:
    """count: this rank's need (a 0-d or [1] integer tensor on the device). Returns the group's
    overflow as a 0-d bool tensor, the same on every rank (an all-reduce of the worst count, no
    host wait on CUDA). On the CPU an overflow raises here, on every rank."""
    worst = count.to(torch.int64).reshape(1).clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    overflow = worst[0] > capacity
    if not worst.is_cuda and bool(overflow):  # known without waiting: refuse before exchanging
        raise overflow_error(int(worst[0]), capacity, what)
    if worst.is_cuda and _capturing():  # rewritten by every replay
        _captured.append((torch.stack([worst[0], worst[0].new_full((), capacity)]), what))
    elif worst.is_cuda:  # the report, read by check_capacity without waiting here
        flag = torch.empty(2, dtype=torch.int64, pin_memory=True)
        flag.copy_(torch.stack([worst[0], worst[0].new_full((), capacity)]), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        _pending.append((event, flag, what))
    return overflow


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never before CUDA is initialised:
    asking must not initialise it in CPU-only processes)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def poison(out: torch.Tensor, overflow: torch.Tensor) -> torch.Tensor:
    """out, or NaN everywhere when the group overflowed."""
    return torch.where(overflow, torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)
