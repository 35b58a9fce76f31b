"""Expert parallelism over two CPU processes under torchrun (loopback only, bounded time)."""
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_under_torchrun_match_one_rank():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOKA_COMM_TIMEOUT_S": "30"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(Path(__file__).with_name("ep_worker.py"))]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    for rank in (0, 1):
        assert f"rank {rank}: bad input on rank 1 raised" in log, log
        assert f"rank {rank}: ok" in log, log
