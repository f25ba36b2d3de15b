"""Two ranks exchange tensors through the pipeline's Channel in strict mode (or coalesced).

Usage: torchrun --nproc_per_node=2 p2p_worker.py (paired | coalesced | unpaired)
"paired": each rank posts its send and its receive in one batch (completes);
"coalesced": the same batch answered with one work, as NCCL answers it (PIPETX_COALESCED_P2P=1):
the exchange returns with the receive in its tensor;
"unpaired": each rank posts its send alone, then its receive (a deadlock under NCCL's rule,
which strict mode must turn into a timeout error).
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from worker_exit import run_worker

from lightning_pipetx.strategy.p2p import Channel


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    channel = Channel(torch.device("cpu"), timeout=timedelta(seconds=5), strict=sys.argv[1] != "coalesced")
    outgoing, incoming = torch.full((4,), float(rank)), torch.empty(4)
    if sys.argv[1] in ("paired", "coalesced"):
        assert channel.coalesced == (sys.argv[1] == "coalesced")
        channel.exchange([(outgoing, peer)], [(incoming, peer)])
        assert torch.equal(incoming, torch.full((4,), float(peer)))  # before any flush
    else:
        channel.exchange([(outgoing, peer)], [])
        channel.exchange([], [(incoming, peer)])
    channel.flush()
    assert torch.equal(incoming, torch.full((4,), float(peer)))
    print(f"rank {rank} exchanged")


if __name__ == "__main__":
    run_worker(main)
