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

- On CUDA: PullTransport, through torch's symmetric memory (its default CUDA backend, the
  staging buffer of machmoe.symmetric_exchange, shared with the all-gather exchange) and our own
  kernel, machmoe's pull_rows op (src/kernels/exchange/pull_rows.cuh). Each rank writes its rows
  (each padded to a multiple of 16 bytes) and its send_counts into its staging buffer; after a
  barrier of the group, the kernel reads every peer's counts over NVLink, works out which rows
  are this rank's and where they land, and copies them with 16-byte loads from the peers'
  buffers; a second barrier keeps every rank from overwriting its buffer while a peer still
  reads it. The counts never reach the host, so a forward and backward do not wait for it and
  can be captured in a CUDA graph.
- On the CPU (gloo): the counts moved to the host and torch.distributed.all_to_all_single
  (host_count_transport), the same rows in the same places, for tests.
- One rank (W = 1): the rows stay where they are (local_transport), on any device.
"""

from __future__ import annotations

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


def pull_unavailable_reason(device: torch.device) -> str | None:
    """None where PullTransport runs on `device`, else why not: it needs torch's symmetric memory
    and machmoe's compiled pull_rows op on a Hopper GPU."""
    from . import _ops, symmetric_exchange

    if not symmetric_exchange._torch_has_symmetric_memory():
        return "this torch has no symmetric memory (torch.distributed._symmetric_memory)"
    return _ops.kernels_unavailable_reason(device)


# Bytes before the rows in the staging buffer: the send counts [W] int64 (W <= 64, pull_rows's
# bound), padded so that the rows start 16-byte aligned.
HEADER_BYTES = 512
ROW_ALIGN = 16  # pull_rows copies 16-byte vectors: rows are padded to a multiple of this

# group name -> (staging handle, its peers' base addresses [W] int64 on the device)
_PEERS: dict = {}


def _staging_and_peers(group_name: str, nbytes: int):
    """symmetric_exchange's staging handle of the group, grown to nbytes if needed, and the device
    array of every rank's staging address that pull_rows reads (made when the handle is new: a
    host-to-device copy, outside any capture)."""
    from . import symmetric_exchange

    handle = symmetric_exchange._staging(group_name, nbytes)
    held = _PEERS.get(group_name)
    if held is None or held[0] is not handle:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "exchange='all_to_all_device': its staging buffer is new inside a CUDA-graph capture; run "
                "one call of the same shapes before capturing")
        peers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=torch.cuda.current_device())
        held = _PEERS[group_name] = (handle, peers)
    return held


class PullTransport:
    """The CUDA transport of one group (module docstring): staged rows, a barrier, the pull_rows
    kernel, a barrier. recv_counts is not read: the kernel reads the senders' own counts.

    Why two barriers and one staging buffer rather than alternating two buffers: the second
    barrier costs microseconds against the megabytes moved, and with it the buffer is free after
    every call, so it can be the one the all-gather exchange already holds (no extra memory, and
    any order of calls of either exchange on one stream is safe)."""

    _instances: dict = {}

    @classmethod
    def get(cls, group_name: str, W: int, device: torch.device) -> "PullTransport":
        key = (group_name, device.index)
        if key not in cls._instances:
            cls._instances[key] = cls(group_name, W, device)
        return cls._instances[key]

    def __init__(self, group_name: str, W: int, device: torch.device):
        reason = pull_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"exchange='all_to_all_device' on CUDA needs machmoe's pull_rows kernel and "
                               f"torch's symmetric memory: {reason}. Use exchange='all_to_all' or 'all_gather'")
        if W > HEADER_BYTES // 8:
            raise ValueError(f"exchange='all_to_all_device' on CUDA: the group has W = {W} ranks, more than the "
                             f"{HEADER_BYTES // 8} its pull_rows kernel reads counts from")
        self.group_name, self.W, self.device = group_name, W, device

    def __call__(self, parts, send_counts, recv_counts, out_rows):
        from .symmetric_exchange import BARRIER_TIMEOUT_MS

        R = parts[0].shape[0]
        B = sum(p.shape[1] for p in parts)
        padded = -(-B // ROW_ALIGN) * ROW_ALIGN  # row bytes as staged; the padding travels unread
        handle, peers = _staging_and_peers(self.group_name, HEADER_BYTES + R * padded)
        rank = handle.rank
        rows = handle.get_buffer(rank, (R, padded), torch.uint8, HEADER_BYTES)  # [R, padded]
        start = 0
        for p in parts:  # side by side
            rows[:, start:start + p.shape[1]].copy_(p)
            start += p.shape[1]
        handle.get_buffer(rank, (self.W,), torch.int64, 0).copy_(send_counts)
        handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        out = torch.ops.machmoe.pull_rows(peers, 0, HEADER_BYTES, R, rank, out_rows, padded)
        handle.barrier(channel=1, timeout_ms=BARRIER_TIMEOUT_MS)
        return out[:, :B]


def pull_rows_reference(peers: list, header_offset: int, rows_offset: int, src_rows: int, rank: int,
                        out_rows: int, row_bytes: int) -> tuple:
    """machmoe's pull_rows op in PyTorch, on the peers' staging buffers given as 1-D uint8 tensors
    (for tests) -> (out [out_rows, row_bytes] uint8, written [out_rows] bool): peer q's rows for
    `rank` (after its rows for lower ranks) land at the prefix of what lower peers send here, in
    sender order, every count clamped to [0, src_rows]; rows landing past out_rows or lying past
    src_rows are skipped. Rows not written are 0 here (the op leaves them as they were)."""
    W = len(peers)
    out = torch.zeros(out_rows, row_bytes, dtype=torch.uint8, device=peers[0].device)
    written = torch.zeros(out_rows, dtype=torch.bool, device=peers[0].device)
    at = 0
    for buf in peers:
        counts = buf[header_offset:header_offset + 8 * W].view(torch.int64).clamp(0, src_rows).tolist()
        first, n = sum(counts[:rank]), counts[rank]
        rows = buf[rows_offset:rows_offset + src_rows * row_bytes].view(src_rows, row_bytes)
        take = max(0, min(n, src_rows - first, out_rows - at))
        out[at:at + take] = rows[first:first + take]
        written[at:at + take] = True
        at += n
    return out, written
