"""A tiny GPT-2 (from a config, no download) on padded variable-length sequences, and the plain-torch large-batch
reference the Hugging Face integrations are compared with (tests/transformers_tasks.py, tests/accelerate_tasks.py).

The reference runs in one process: for each window it takes every rank's micro-batches of the window, runs each
sample ALONE (no padding), sums the cross-entropy of every next-token target and divides by the number of targets
of the whole window; then clips (optionally), steps AdamW and a linear-decay LR whose total is the exact step count.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import torch

from distributed import leave

WORLD = 2
MICRO = 2  # samples per micro-batch
PER_RANK = 7  # micro-batches per rank per epoch: partial windows of 1 (factor 2) and 3 (factor 4)
N = MICRO * PER_RANK * WORLD
SCHEDULE = {1: 2, 2: 4}  # epoch 0: factor 1, epoch 1: 2, epoch 2: 4
EPOCHS = 3
LR = 0.01
MAX_GRAD_NORM = 1.0
# Adam's epsilon: GPT-2's attention key bias has an exactly zero true gradient (softmax ignores a per-query constant),
# so its gradient is rounding noise (~1e-9), which Adam at eps=1e-8 turns into lr-sized steps that differ between any
# two summation orders (measured: 1.3e-4 on that bias, <3e-7 everywhere else). At 1e-4 the noise moves nothing.
ADAM_EPS = 1e-4
VOCAB, MAX_LEN = 32, 9
# fp16's initial loss scale: at torch's 2**16 the summed token losses of a window overflow fp16 in the backward (a
# skipped step), which the large-batch reference, dividing by the count first, does not
FP16_INIT_SCALE = 2.0 ** 10


def config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)


def make_model():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(config())


def samples() -> list[list[int]]:
    """N token sequences of 2..MAX_LEN tokens (1..MAX_LEN-1 targets each)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, MAX_LEN + 1, (N,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


class Sequences(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = samples()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def collate(rows: list[dict]) -> dict:
    """Right padding with id 0; labels = input_ids on real tokens, -100 on padding."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def factors(schedule=SCHEDULE, epochs: int = EPOCHS) -> list[int]:
    return [max([f for e, f in schedule.items() if e <= epoch], default=1) for epoch in range(epochs)]


def total_steps(schedule=SCHEDULE, epochs: int = EPOCHS) -> int:
    return sum(math.ceil(PER_RANK / f) for f in factors(schedule, epochs))


def sequential_order(epoch: int, rank: int) -> list[list[int]]:
    """Sample indices of each micro-batch of ``rank`` under a sequential sampler sharded by Accelerate: rank r
    gets global batches r, r + WORLD, ... (each MICRO consecutive samples)."""
    return [list(range((m * WORLD + rank) * MICRO, (m * WORLD + rank + 1) * MICRO)) for m in range(PER_RANK)]


def linear_decay(total: int):
    return lambda step: max(0.0, (total - step) / max(1, total))


def _fresh_run(schedule, epochs: int):
    """(samples, model, AdamW, its linearly decaying LR over the schedule's step total) as every reference starts."""
    model = make_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.0)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_decay(total_steps(schedule, epochs)))
    return samples(), model, optimizer, lr_sched


def reference(order=sequential_order, schedule=SCHEDULE, epochs: int = EPOCHS, max_grad_norm=MAX_GRAD_NORM):
    """(parameters by name, optimizer steps) of the plain-torch large-batch run."""
    rows, model, optimizer, lr_sched = _fresh_run(schedule, epochs)
    steps = 0
    for epoch, factor in enumerate(factors(schedule, epochs)):
        per_rank = [order(epoch, r) for r in range(WORLD)]
        for start in range(0, PER_RANK, factor):
            window = [i for r in range(WORLD) for m in range(start, min(start + factor, PER_RANK))
                      for i in per_rank[r][m]]
            optimizer.zero_grad()
            loss_sum, targets = 0.0, 0
            for i in window:  # each sample alone: no padding anywhere
                ids = torch.tensor(rows[i])[None]
                logits = model(input_ids=ids).logits[0, :-1]
                loss_sum = loss_sum + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
                targets += ids.shape[1] - 1
            (loss_sum / targets).backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            lr_sched.step()
            steps += 1
    return {name: p.detach().clone() for name, p in model.named_parameters()}, steps


def token_loss(model, batch, seen: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(SUM of the next-token cross-entropy over real targets, number of real targets) of a padded micro-batch;
    the logits' dtype is appended to ``seen`` (what precision the forward really ran in)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if seen is not None:
        seen.append(logits.dtype)
    logits, targets = logits[:, :-1], batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss, targets.ne(-100).sum()


def amp_reference(dtype: torch.dtype, order=sequential_order, schedule=SCHEDULE, epochs: int = EPOCHS,
                  max_grad_norm=MAX_GRAD_NORM):
    """(parameters by name, optimizer steps, loss scales) of plain torch AMP on one large batch per window: the
    low-precision forward depends on each padded micro-batch's shape, so here every rank's micro-batches of the
    window run as they do on the ranks (same padding, autocast to ``dtype`` on CPU), their token-loss sums divided
    by the window's real target count; fp16 with torch's GradScaler (unscale, clip, step, update). Loss scales:
    the scaler's scale after each step (fp16), to show no step overflowed."""
    rows, model, optimizer, lr_sched = _fresh_run(schedule, epochs)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE, enabled=dtype == torch.float16)
    steps, scales = 0, []
    for epoch, factor in enumerate(factors(schedule, epochs)):
        per_rank = [order(epoch, r) for r in range(WORLD)]
        for start in range(0, PER_RANK, factor):
            batches = [collate([{"input_ids": rows[i]} for i in per_rank[r][m]]) for r in range(WORLD)
                       for m in range(start, min(start + factor, PER_RANK))]
            targets = sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in batches)
            optimizer.zero_grad()
            for batch in batches:
                with torch.autocast("cpu", dtype=dtype):
                    loss_sum, _ = token_loss(model, batch)
                scaler.scale(loss_sum / targets).backward()
            scaler.unscale_(optimizer)
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            lr_sched.step()
            steps += 1
            scales.append(scaler.get_scale() if scaler.is_enabled() else None)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, steps, scales


def gap(params: dict, ref: dict) -> float:
    """Largest |parameter - reference| over every parameter (by name)."""
    return max((params[name] - r).abs().max().item() for name, r in ref.items())


TESTS = os.path.dirname(os.path.abspath(__file__))


def launch(script: str, out, variants) -> dict:
    """``tests/<script> OUT VARIANT...`` under torchrun on WORLD ranks: each variant's saved result, per rank."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               os.path.join(TESTS, script), str(out), *variants]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {v: [torch.load(os.path.join(out, f"{v}-{rank}.pt")) for rank in range(WORLD)] for v in variants}


def save_variants(run, out_dir: str, variants: list[str]) -> None:
    """A rank's side of :func:`launch`: ``run(variant)`` for each variant, saved where launch() reads it."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("RANK", "0"))
    for variant in variants:
        torch.save(run(variant), os.path.join(out_dir, f"{variant}-{rank}.pt"))
    leave()
