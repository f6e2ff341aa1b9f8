"""A Hugging Face Trainer whose accumulation factor follows a schedule (docs/transformers.md).

    torchrun --nproc-per-node 2 examples/hf_trainer.py      # or: python examples/hf_trainer.py (one process)

A tiny GPT-2 built from a config (nothing is downloaded) learns padded random sequences on CPU; the factor is 1 in
epoch 0, 2 in epoch 1 and 4 from epoch 2 on. Prints the optimizer steps taken and the total the LR scheduler got.
"""
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from accum_sched.integrations.transformers import AccumulationTrainer


class RandomSequences(torch.utils.data.Dataset):
    def __init__(self, n=56, vocab=64):
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, 17, (n,), generator=g).tolist()
        self.rows = [torch.randint(1, vocab, (k,), generator=g) for k in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad(rows):  # right padding; labels -100 on padding, so only real next-token targets count
    ids = torch.nn.utils.rnn.pad_sequence([r["input_ids"] for r in rows], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(r["input_ids"]) for r in rows], batch_first=True)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                       eos_token_id=1))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_train_epochs=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], logging_steps=5, save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True)   # gradient_accumulation_steps stays 1
    trainer = AccumulationTrainer(model=model, args=args, train_dataset=RandomSequences(), data_collator=pad,
                                  accumulation_schedule={0: 1, 1: 2, 2: 4})
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"optimizer steps {trainer.state.global_step}, LR total {trainer.state.max_steps}, "
              f"final lr {trainer.lr_scheduler.get_last_lr()[0]:.3g}")


if __name__ == "__main__":
    main()
