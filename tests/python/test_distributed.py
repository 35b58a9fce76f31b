"""Expert parallelism over two CPU processes under torchrun (loopback only, bounded time)."""
from conftest import run_ep_worker


def test_two_ranks_under_torchrun_match_one_rank():
    log = run_ep_worker()
    for rank in (0, 1):
        assert f"rank {rank}: bad input on rank 1 raised" in log, log
        assert f"rank {rank}: ok" in log, log
