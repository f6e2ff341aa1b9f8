"""Built-in tasks: `builtin:regression` (synthetic, deterministic) and `builtin:charlm` (a small character-level
transformer language model on a corpus shipped with the package; variable-length lines, padding excluded from the
loss, so each step is normalised per token)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset


# -- regression -------------------------------------------------------------------------------------------------
def regression(samples: int = 2048, in_dim: int = 32, hidden: int = 64, out_dim: int = 8, noise: float = 0.05,
               data_seed: int = 1234, val_samples: int = 0):
    """y = tanh(x @ W) + noise, fitted by a two-hidden-layer MLP. Deterministic given ``data_seed``.
    ``val_samples`` > 0 adds a validation set: more samples of the same function."""
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(samples + val_samples, in_dim, generator=g)
    w = torch.randn(in_dim, out_dim, generator=g) / in_dim**0.5
    y = torch.tanh(x @ w * 2.0) + noise * torch.randn(samples + val_samples, out_dim, generator=g)
    model = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                          nn.Linear(hidden, out_dim))

    def loss_fn(model, batch):
        inputs, targets = batch
        per_sample = ((model(inputs) - targets) ** 2).mean(-1)  # one element per sample
        return per_sample.sum(), inputs.shape[0]

    task = {"model": model, "dataset": TensorDataset(x[:samples], y[:samples]), "loss_fn": loss_fn}
    if val_samples:
        task["val_dataset"] = TensorDataset(x[samples:], y[samples:])
    return task


# -- charlm -----------------------------------------------------------------------------------------------------
PAD = 0
CORPUS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "corpus.txt")  # launcher/data


class LineDataset(Dataset):
    """One sample per corpus line (or chunk of ``max_len``), encoded as character ids; lengths vary."""

    def __init__(self, path: str, max_len: int):
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
        chars = sorted({c for line in lines for c in line})
        self.vocab = {c: i + 2 for i, c in enumerate(chars)}  # 0 = padding, 1 = start of line
        self.samples = []
        for line in lines:
            ids = [1] + [self.vocab[c] for c in line]
            for start in range(0, len(ids) - 1, max_len):
                chunk = ids[start:start + max_len + 1]
                if len(chunk) > 1:
                    self.samples.append(torch.tensor(chunk, dtype=torch.long))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab) + 2

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def pad_batch(sequences: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=PAD)


class CharTransformer(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, max_len: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len + 1, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(length, device=tokens.device))[None]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        h = self.blocks(h, mask=causal, is_causal=True)
        return self.head(self.norm(h))


def charlm(max_len: int = 64, d_model: int = 64, n_heads: int = 4, n_layers: int = 2, dropout: float = 0.0,
           corpus: str | None = None, val_fraction: float = 0.0):
    """Next-character prediction. loss_fn returns (sum of token losses, number of real target tokens).
    ``val_fraction`` > 0 holds that share of the samples out (a fixed random choice) as the validation set, with
    token accuracy as a metric."""
    dataset = LineDataset(corpus or CORPUS, max_len)
    model = CharTransformer(dataset.vocab_size, d_model, n_heads, n_layers, max_len, dropout)
    train, val = dataset, None
    if val_fraction > 0:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
        cut = max(1, round(len(dataset) * val_fraction))
        train, val = Subset(dataset, order[cut:]), Subset(dataset, order[:cut])

    def loss_fn(model, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                 ignore_index=PAD, reduction="sum")
        return losses, (targets != PAD).sum()

    def count_fn(tokens):
        return int((tokens[:, 1:] != PAD).sum())

    def metrics_fn(model, tokens):
        targets = tokens[:, 1:]
        real = targets != PAD
        correct = (model(tokens[:, :-1]).argmax(-1) == targets) & real
        return {"accuracy": (correct.sum(), real.sum())}

    task = {"model": model, "dataset": train, "loss_fn": loss_fn, "collate_fn": pad_batch, "count_fn": count_fn,
            "length_fn": lambda sample: len(sample) - 1}  # its targets: every token but the first
    if val is not None:
        task.update(val_dataset=val, metrics_fn=metrics_fn)
    return task
