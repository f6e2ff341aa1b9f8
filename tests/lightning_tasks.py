"""One torchrun launch under Lightning's DDP (2 CPU ranks, gloo): the same small fit three ways, plus the plain-torch
large-batch reference they are compared with.

    torchrun --nproc-per-node 2 tests/lightning_tasks.py OUT_DIR

Cases: ``samples`` (SGD, one element per sample) and ``tokens`` (AdamW + a linear-decay LambdaLR whose total is the
integration's step total; 1-3 real tokens of 3 per sample), each with this project's integration
(``<case>-accum``) and with Lightning's ``GradientAccumulationScheduler`` (``<case>-lightning``). Each rank saves
its final parameters, the gradient all-reduces counted here (the test's own counter: every all_reduce at least as
large as the model, i.e. a gradient bucket), the optimizer steps and the wall-clock seconds of its fit.
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings

import torch

from distributed import leave

SCHEDULE = {6: 2, 11: 4}
EPOCHS = 12
MICRO = 2  # samples per micro-batch
WORLD = 2
PER_RANK = 7  # micro-batches per rank per epoch: partial windows at factors 2 and 4
N = MICRO * PER_RANK * WORLD
SEQ = {"samples": 1, "tokens": 3}
CASES = ("samples", "tokens")


def dataset(case: str) -> torch.utils.data.TensorDataset:
    """x, y per token position, and a mask of the real tokens (all ones for ``samples``)."""
    g = torch.Generator().manual_seed(1)
    seq = SEQ[case]
    x, y = torch.randn(N, seq, 4, generator=g), torch.randn(N, seq, 1, generator=g)
    if case == "samples":
        mask = torch.ones(N, seq)
    else:
        lengths = torch.randint(1, seq + 1, (N,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    return torch.utils.data.TensorDataset(x, y, mask)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss_terms(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(SUM of squared errors over real tokens, number of real tokens)."""
    x, y, mask = batch
    err = ((model(x) - y) ** 2).squeeze(-1) * mask
    return err.sum(), mask.sum()


def make_optimizer(case: str, params, total: int):
    if case == "samples":
        return torch.optim.SGD(params, lr=0.1), None
    optimizer = torch.optim.AdamW(params, lr=0.01)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (total + 1))


def rank_indices(epoch: int, rank: int) -> list[int]:
    """The samples DistributedSampler (shuffle, seed 0, as Lightning builds it) gives ``rank`` in ``epoch``."""
    sampler = torch.utils.data.DistributedSampler(range(N), num_replicas=WORLD, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def reference(case: str) -> tuple[list[torch.Tensor], int]:
    """Plain torch: each window is one batch of every rank's samples of the window, mean over its real tokens."""
    data = dataset(case)
    model = make_model()
    factors = [max([f for e, f in SCHEDULE.items() if e <= epoch], default=1) for epoch in range(EPOCHS)]
    total = sum(math.ceil(PER_RANK / f) for f in factors)
    optimizer, lr_sched = make_optimizer(case, model.parameters(), total)
    steps = 0
    for epoch, factor in enumerate(factors):
        per_rank = [rank_indices(epoch, r) for r in range(WORLD)]
        for start in range(0, PER_RANK, factor):
            window = [i for r in range(WORLD) for m in range(start, min(start + factor, PER_RANK))
                      for i in per_rank[r][m * MICRO:(m + 1) * MICRO]]
            loss_sum, n = loss_terms(model, data[window])
            optimizer.zero_grad()
            (loss_sum / n).backward()
            optimizer.step()
            if lr_sched is not None:
                lr_sched.step()
            steps += 1
    return [p.detach().clone() for p in model.parameters()], steps


def _modules(case: str, use_accum: bool):
    import lightning.pytorch as pl

    from accum_sched.integrations.lightning import AccumulationMixin

    class Accum(AccumulationMixin, pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.total = None

        def forward(self, x):
            return self.net(x)

        def accumulation_loss(self, batch, batch_idx):
            return loss_terms(self.net, batch)

        def configure_optimizers(self):
            self.total = self.accumulation_total_steps()
            optimizer, lr_sched = make_optimizer(case, self.parameters(), self.total)
            if lr_sched is None:
                return optimizer
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_sched, "interval": "step"}}

    class Plain(pl.LightningModule):  # Lightning's rule: each micro-batch's mean, divided by the factor
        def __init__(self):
            super().__init__()
            self.net = make_model()
            self.total = None

        def training_step(self, batch, batch_idx):
            loss_sum, n = loss_terms(self.net, batch)
            return loss_sum / n

        def configure_optimizers(self):
            self.total = int(self.trainer.estimated_stepping_batches)  # Lightning's own estimate
            optimizer, lr_sched = make_optimizer(case, self.parameters(), self.total)
            if lr_sched is None:
                return optimizer
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_sched, "interval": "step"}}

    return Accum() if use_accum else Plain()


def _fit(case: str, use_accum: bool) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from accum_sched.integrations.lightning import ScheduledAccumulation
    from counters import CollectiveCounter

    module = _modules(case, use_accum)
    n_params = sum(p.numel() for p in module.parameters())
    callback = ScheduledAccumulation(SCHEDULE) if use_accum else GradientAccumulationScheduler(SCHEDULE)
    loader = torch.utils.data.DataLoader(dataset(case), batch_size=MICRO, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=EPOCHS, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    counter = CollectiveCounter()
    start = time.perf_counter()
    with counter:
        trainer.fit(module, loader)
    seconds = time.perf_counter() - start
    gradient_allreduces = sum(1 for name, numel in counter.calls if name == "all_reduce" and numel >= n_params)
    steps = callback.optimizer_steps if use_accum else trainer.global_step
    return {"params": [p.detach().clone() for p in module.net.parameters()], "allreduces": gradient_allreduces,
            "steps": steps, "total": module.total, "seconds": seconds}


def main(out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    for case in CASES:
        for use_accum in (True, False):
            result = _fit(case, use_accum)
            name = f"{case}-{'accum' if use_accum else 'lightning'}"
            torch.save(result, os.path.join(out_dir, f"{name}-{rank}.pt"))
    leave()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1])
