"""An Accelerate loop whose accumulation factor follows a schedule (docs/accelerate.md).

    accelerate launch --num_processes 2 --cpu examples/accelerate_loop.py   # or torchrun --nproc-per-node 2, or python

A tiny GPT-2 built from a config (nothing is downloaded) learns padded random sequences on CPU; the factor is 1 in
epoch 0, 2 in epoch 1 and 4 from epoch 2 on. Prints, per epoch, the factor and the optimizer steps so far.
"""
import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from accum_sched import AccumulationSchedule
from accum_sched.integrations.accelerate import make_engine

EPOCHS = 4


def random_sequences(n=56, vocab=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (k,), generator=g) for k in torch.randint(2, 17, (n,), generator=g).tolist()]


def pad(rows):  # right padding; labels -100 on padding
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                       eos_token_id=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(random_sequences(), batch_size=4, collate_fn=pad)
    schedule = AccumulationSchedule({0: 1, 1: 2, 2: 4})
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    total = schedule.optimizer_steps(len(loader), EPOCHS)  # exact: the prepared loader's length per rank
    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
    engine = make_engine(accelerator, model, optimizer, schedule, lr_scheduler=lr_sched, max_grad_norm=1.0)
    for epoch in range(EPOCHS):
        for batch in engine.micro_batches(loader, epoch):      # no_sync() off the window's boundary
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            targets = batch["labels"][:, 1:]                    # token t predicts token t+1
            loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                                         ignore_index=-100, reduction="sum")
            engine.backward(loss_sum, targets.ne(-100).sum())   # SUM over real targets, and how many
        accelerator.print(f"epoch {epoch}: factor {engine.factor}, optimizer steps {engine.optimizer_steps} "
                          f"of {total}, loss {engine.last_step.loss:.3f}")


if __name__ == "__main__":
    main()
