"""Transports of the device-counted all-to-all exchange (machmoe.expert_device_exchange): an
all-to-all of packed byte rows whose per-peer row counts stay on the device.

A transport is a function

    transport(parts, send_counts, recv_counts, out_rows) -> received [out_rows, B] uint8

parts: uint8 tensors [R, b_i] with the same R, side by side one row of B = Σ b_i bytes (rows
[0, Σ send_counts) are sent: chunk q, send_counts[q] rows in order, to rank q). send_counts,
recv_counts: [W] int64 on the device, this rank's rows to and from each rank (recv_counts[q] is
what rank q sends here; every rank's view agrees). The result holds the received rows in sender
order, rank 0's first, at rows [0, Σ recv_counts); rows past that are unspecified (the caller
masks them). The caller guarantees Σ recv_counts <= out_rows and Σ send_counts <= R, and that
every rank makes the same sequence of calls with the same R, B and out_rows.

- On CUDA: torch's symmetric memory on the NVSHMEM backend, `torch.ops.symm_mem.all_to_all_vdev`
  (NvshmemTransport): the counts never leave the device, so a forward and backward do not wait
  for the host and can be captured in a CUDA graph.
- On the CPU (gloo): the counts moved to the host and torch.distributed.all_to_all_single
  (host_count_transport), the same rows in the same places, for tests.
- One rank (W = 1): the rows stay where they are (local_transport), on any device.

The op's contract, as torch 2.11 implements it: input, out, in_splits [W] int64 and
out_splits_offsets [2, W] int64 all live in symmetric memory (symm_mem.empty, then a rendezvous
on the group); rows are dim 0 of input, of input.stride(0) · element size bytes; rank r pulls
in_splits[r] rows of every peer's input from the peer's exclusive prefix sum of its in_splits,
and writes them at the exclusive prefix sum of what it receives; out_splits_offsets is written
with the received counts (row 0) and their offsets (row 1). Nothing bounds the writes by out's
size: the caller's capacity check (an overflow sends no rows at all) is what keeps them inside.

One more rule of that kernel: it splits each peer's bytes (rows · row bytes) evenly over
blocks_per_peer = num_blocks // W thread blocks and asserts on the device that they divide
evenly. num_blocks comes from the input's bytes (one per 64 KiB, rounded up to a multiple of W,
at most 64 within a host and 16 across; older builds: 8 to 64 by size, 64 from 4 MiB), or from
TORCH_SYMMMEM_NBLOCKS. So NvshmemTransport hands the op an input of at least 4 MiB (num_blocks
then 64, 16 or 8, or the variable's value) and pads each row to a multiple of every
blocks_per_peer those give (row_quantum): any row count then divides evenly.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.distributed as dist


def host_count_transport(group):
    """The CPU stand-in: counts to the host (a wait, fine on the CPU), then all_to_all_single."""

    def transport(parts, send_counts, recv_counts, out_rows):
        rows = torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()
        send, recv = send_counts.tolist(), recv_counts.tolist()
        if sum(recv) > out_rows or sum(send) > rows.shape[0]:
            raise RuntimeError(f"device-counted exchange: {sum(send)} rows to send from {rows.shape[0]}, "
                               f"{sum(recv)} to receive into {out_rows}")
        out = rows.new_zeros(out_rows, rows.shape[1])
        dist.all_to_all_single(out[:sum(recv)], rows[:sum(send)].contiguous(), recv, send, group=group)
        return out

    return transport


def local_transport(parts, send_counts, recv_counts, out_rows):
    """W = 1: the sent rows are the received ones. Copies the first min(R, out_rows) rows, which
    hold every sent row (the caller's capacity check keeps their count within out_rows) and
    needs no count on the host."""
    rows = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    out = rows.new_zeros(out_rows, rows.shape[1])
    keep = min(rows.shape[0], out_rows)
    out[:keep] = rows[:keep]
    return out


@functools.lru_cache(maxsize=None)
def nvshmem_unavailable_reason() -> str | None:
    """None where torch's NVSHMEM symmetric memory runs here, else why not (looked up once)."""
    try:
        import torch.distributed._symmetric_memory as symm
    except ImportError:
        return "this torch has no symmetric memory (torch.distributed._symmetric_memory)"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return "this torch has no torch.ops.symm_mem.all_to_all_vdev"
    if not symm.is_nvshmem_available():
        return "NVSHMEM is not available (torch built without it, or libnvshmem_host.so.3 not found)"
    return None


def _use_nvshmem_backend(device: torch.device) -> None:
    """Symmetric memory on the NVSHMEM backend: set once per process, before its first
    symmetric allocation (torch refuses a change after one)."""
    import torch.distributed._symmetric_memory as symm

    reason = nvshmem_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"exchange='all_to_all_device' needs torch's NVSHMEM symmetric memory on CUDA: "
                           f"{reason}. Use exchange='all_to_all' with max_tokens (fixed blocks) instead")
    if symm.get_backend(device) == "NVSHMEM":
        return
    try:
        symm.set_backend("NVSHMEM")
    except Exception as err:  # another backend was chosen, or memory already allocated on it
        raise RuntimeError(
            "exchange='all_to_all_device' needs symmetric memory on the NVSHMEM backend, but this "
            f"process already uses {symm.get_backend(device)!r} (set before the first symmetric "
            "allocation; the all-gather exchange on CUDA allocates on the default backend): "
            "create the first all_to_all_device layer call before any other symmetric-memory use, "
            f"or call torch.distributed._symmetric_memory.set_backend('NVSHMEM') first ({err})") from err


# The least bytes of the input the op is given (see the module docstring).
MIN_INPUT_BYTES = 4 << 20


def row_quantum(W: int) -> int:
    """Row bytes are padded to a multiple of this: of 16 (aligned rows), and of every
    blocks_per_peer the op may use on an input of MIN_INPUT_BYTES or more over W ranks."""
    blocks = [64, 16, 8]
    if os.environ.get("TORCH_SYMMMEM_NBLOCKS", "").isdigit():
        blocks.append(int(os.environ["TORCH_SYMMMEM_NBLOCKS"]))
    return math.lcm(16, *(max(b // W, 1) for b in blocks))


class _Buffers:
    """One direction's symmetric buffers on one group: send and receive bytes, in_splits [W]
    and out_splits_offsets [2, W] int64, each rendezvoused once (the op's own rendezvous then
    finds them cached: the first rendezvous is a blocking collective, not capturable)."""

    def __init__(self, send_bytes: int, recv_bytes: int, W: int, group_name: str, device):
        import torch.distributed._symmetric_memory as symm

        self.send = symm.empty(send_bytes, dtype=torch.uint8, device=device)
        self.recv = symm.empty(recv_bytes, dtype=torch.uint8, device=device)
        self.in_splits = symm.empty(W, dtype=torch.int64, device=device)
        self.out_splits_offsets = symm.empty(2, W, dtype=torch.int64, device=device)
        for t in (self.send, self.recv, self.in_splits, self.out_splits_offsets):
            symm.rendezvous(t, group_name)


class NvshmemTransport:
    """The CUDA transport of one group and one direction ("to_experts": the dispatch and the
    combine's backward; "to_tokens": the combine and the dispatch's backward).

    Reuse of the buffers without a barrier of our own. The op is pull-based: a peer reads this
    rank's send buffer, and writes this rank's out_splits_offsets, during its own call. Each
    call begins with a device barrier of the whole group (in its splits exchange), so when this
    rank enters call n + 1 every peer has finished call n - 1 (same stream, in order), not
    necessarily call n. Two calls in a row on the same buffers could therefore race; the layer
    never makes them: its calls alternate between the two directions (a forward is dispatch then
    combine, a backward the combine's then the dispatch's), and a forward's dispatch comes after
    the count exchange and the overflow all-reduce (NCCL), which no rank finishes before every
    peer has finished its earlier work.
    """

    _instances: dict = {}

    @classmethod
    def get(cls, group_name: str, W: int, direction: str, device: torch.device) -> "NvshmemTransport":
        key = (group_name, direction, device.index)
        if key not in cls._instances:
            cls._instances[key] = cls(group_name, W, device)
        return cls._instances[key]

    def __init__(self, group_name: str, W: int, device: torch.device):
        _use_nvshmem_backend(device)
        self.group_name, self.W, self.device = group_name, W, device
        self.quantum = row_quantum(W)
        self.buffers = None  # _Buffers, made at the first call

    def _buffers(self, send_bytes: int, recv_bytes: int) -> _Buffers:
        held = self.buffers
        if held is not None and held.send.numel() >= send_bytes and held.recv.numel() >= recv_bytes:
            return held
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"exchange='all_to_all_device': its symmetric buffers must grow (to {send_bytes} and "
                f"{recv_bytes} bytes) inside a CUDA-graph capture; run one call of the same shapes "
                "before capturing")
        # Peers may still read the old buffers: wait for this rank's queued work, and the
        # allocation (NVSHMEM's, collective) and rendezvous then wait for every rank.
        torch.cuda.synchronize(self.device)
        # Sizes are fixed by the layer's settings (max_tokens, K, d, the capacity): the buffers
        # grow once or twice, at the first calls, to the largest of them.
        self.buffers = _Buffers(max(send_bytes, 0 if held is None else held.send.numel()),
                                max(recv_bytes, 0 if held is None else held.recv.numel()),
                                self.W, self.group_name, self.device)
        torch.cuda.synchronize(self.device)
        return self.buffers

    def __call__(self, parts, send_counts, recv_counts, out_rows):
        R = parts[0].shape[0]
        B = sum(p.shape[1] for p in parts)
        padded = -(-B // self.quantum) * self.quantum  # row bytes as sent
        rows_given = max(R, -(-MIN_INPUT_BYTES // padded))  # the op's input: >= MIN_INPUT_BYTES
        buf = self._buffers(rows_given * padded, max(out_rows, 1) * padded)
        rows = buf.send[:rows_given * padded].view(rows_given, padded)
        start = 0
        for p in parts:  # side by side; the padding bytes travel unread
            rows[:R, start:start + p.shape[1]].copy_(p)
            start += p.shape[1]
        buf.in_splits.copy_(send_counts)
        out = buf.recv[:out_rows * padded].view(out_rows, padded)
        torch.ops.symm_mem.all_to_all_vdev(rows, out, buf.in_splits, buf.out_splits_offsets, self.group_name)
        # A view of the receive buffer: the caller copies out of it (its unpacking does) before
        # this direction's next call.
        return out[:, :B]
