"""The README's "your own loop" example, runnable: torchrun --nproc-per-node 2 examples/own_loop.py"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from accum_sched import AccumulationEngine, AccumulationSchedule


def main():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1000, 8), torch.randn(1000, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    ddp_model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2)
    schedule = AccumulationSchedule({0: 1, 2: 2, 4: 4})
    lr_sched = torch.optim.lr_scheduler.LambdaLR(  # totals that know the schedule
        optimizer, lambda s: 1 - s / schedule.optimizer_steps(len(loader), 6))
    engine = AccumulationEngine(ddp_model, optimizer, schedule, lr_scheduler=lr_sched, max_grad_norm=1.0)

    for epoch in range(6):
        sampler.set_epoch(epoch)
        for x, y in engine.micro_batches(loader, epoch):   # forward+backward inside no_sync() off-boundary
            loss_sum = ((ddp_model(x) - y) ** 2).sum()      # SUM of per-sample losses ...
            engine.backward(loss_sum, len(x))               # ... and how many samples it covers
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: factor {engine.factor}, steps {engine.optimizer_steps}, "
                  f"loss {engine.last_step.loss:.4f}")


dist.init_process_group("gloo")
main()  # DDP and the engine are freed when main() returns, before the group is destroyed
dist.destroy_process_group()
