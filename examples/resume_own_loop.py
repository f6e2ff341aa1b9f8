"""docs/resume.md's "From your own loop", runnable: python examples/resume_own_loop.py (one process, a few seconds).

Trains three times from the same start: uninterrupted; stopped in the middle of epoch 1; resumed from what the
stopped run saved, its loader positioned by ResumeSampler. It prints where the stop landed, how many samples the
resumed run loaded (only those after the stop) and whether it ends with the uninterrupted run's parameters, bit for
bit."""
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from accum_sched import AccumulationEngine, ResumeSampler

micro, epochs = 8, 2


class CountingDataset(TensorDataset):
    """Counts the samples it loads: what a resumed loader reads is the point of ResumeSampler."""

    loaded = 0

    def __getitem__(self, index):
        CountingDataset.loaded += 1
        return super().__getitem__(index)


def loss_fn(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).sum(), len(x)  # sum of per-sample losses, how many samples


def train(stop_at_step=None, saved=None) -> dict:
    """Train from scratch, or from ``saved``; ask for a stop after optimizer step ``stop_at_step`` if given."""
    generator = torch.Generator().manual_seed(0)
    dataset = CountingDataset(torch.randn(96, 8, generator=generator), torch.randn(96, 1, generator=generator))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = AccumulationEngine(model, optimizer, {0: 1, 1: 2})
    if stop_at_step is not None:
        engine.on_step(lambda info: engine.request_stop() if info.step == stop_at_step else None)

    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)  # torchrun: leave out 1, 0
    resumable = ResumeSampler(sampler)
    loader = DataLoader(dataset, batch_size=micro, sampler=resumable, num_workers=0)
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        saved_engine_state = saved["engine"]
        engine.load_state_dict(saved_engine_state)            # this rank's own state (see "Preemption")
    CountingDataset.loaded = 0
    for epoch in range(engine.epoch_index, epochs):
        sampler.set_epoch(epoch)
        resumable.start_at(engine.resume_offset(epoch) * micro)   # samples to skip: 0 unless resuming this epoch
        for batch in engine.micro_batches(loader, epoch, skip=False):
            loss_sum, n = loss_fn(model, batch)
            engine.backward(loss_sum, n)
        if engine.should_stop:
            break
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "engine": engine.state_dict()}


uninterrupted = train()
stopped = train(stop_at_step=15)  # epoch 0 is 12 steps (12 micro-batches, factor 1); epoch 1 has factor 2
print(f"stopped at epoch {stopped['engine']['epoch_index']}, micro-batch {stopped['engine']['micro_in_epoch']}")
resumed = train(saved=stopped)
print(f"the resumed run loaded {CountingDataset.loaded} samples")
same = all(torch.equal(resumed["model"][name], value) for name, value in uninterrupted["model"].items())
print(f"same parameters as the uninterrupted run: {same}")
