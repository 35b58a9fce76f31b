"""Expert parallelism: moka's own process groups, bootstrapped over torch.distributed groups and
kept by the group's name (what moka's torch.library ops take, as their arguments are tensors and
scalars only)."""
from __future__ import annotations

import os
import secrets
import socket
from typing import Optional

import torch.distributed as dist

from . import _moka

_groups: dict[str, _moka.Group] = {}


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def moka_group(group: Optional[dist.ProcessGroup]) -> Optional[_moka.Group]:
    """moka's process group over the ranks of ``group`` (None, or a group of one rank: none).

    Collective on first use for a group: every rank of it must call. Its rank 0 picks a free port
    on its address (MASTER_ADDR for the default group, else its host name's address) and a random
    job key; both reach the others through ``group`` (torch.distributed's own channel) and moka
    connects over TCP there, each rank proving it holds the key, so nobody else who reaches the
    port can join; with the CUDA backend moka makes its NCCL communicator from this group. Later
    calls return the same group.
    """
    if group is None or dist.get_world_size(group) == 1:
        return None
    name = group.group_name
    if name not in _groups:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        leader = dist.get_global_rank(group, 0)
        endpoint = [None]
        if rank == 0:
            addr = (os.environ.get("MASTER_ADDR", "127.0.0.1") if leader == 0
                    else socket.gethostbyname(socket.gethostname()))
            addr = socket.gethostbyname(addr)
            endpoint = [(addr, _free_port(addr), secrets.token_hex(32))]
        dist.broadcast_object_list(endpoint, src=leader, group=group)
        addr, port, key = endpoint[0]
        timeout = float(os.environ.get("MOKA_COMM_TIMEOUT_S", "60"))
        _groups[name] = _moka.Group(rank, size, addr, port, timeout, key)
    return _groups[name]


def group_named(name: str) -> Optional[_moka.Group]:
    """moka's group over the torch.distributed group of that name ("": none), bootstrapped here
    where no eager call did it first (a compiled or exported model's first call: collective)."""
    if not name:
        return None
    if name not in _groups:
        moka_group(dist.distributed_c10d._resolve_process_group(name))
    return _groups[name]
