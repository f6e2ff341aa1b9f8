"""The plain torchrun script that start-up is compared with: process group, a small DDP model, one step.

    torchrun --standalone --nproc_per_node 2 bench/plain_first_step.py OUT_FILE

Rank 0 writes one line to OUT_FILE right after its first optimizer step (bench/startup.py times its appearance).
"""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(out_file: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    if dist.get_rank() == 0:
        with open(out_file, "w") as f:
            f.write("first step\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
