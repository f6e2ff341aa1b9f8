"""`builtin:hf_causal_lm` end to end: real torchrun launches on 2 workers (DDP, then DeepSpeed ZeRO-2 starting from
the DDP run's Hugging Face export) equal a plain-torch reference that runs every sample alone, without padding, and
steps on the exact mean over every real next-token target of each window; the `hf/` export loads back with
`from_pretrained`; bad paths stop with one line naming the argument. Tiny models and tokenizers are built here from
configs: nothing is downloaded."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

# The test extra installs transformers and datasets (requires-python >= 3.11, which transformers 5 needs): a missing
# one is an error here, not a silent skip.
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config  # noqa: E402

import paths
from cases import launcher_shards
from launcher.cli import main as cli_main  # noqa: E402
from launcher.errors import ConfigError  # noqa: E402
from launcher.tasks.hf import hf_causal_lm  # noqa: E402

ROOT = paths.ROOT
CORPUS = os.path.join(ROOT, "launcher", "data", "corpus.txt")
HAVE_DS = importlib.util.find_spec("deepspeed") is not None
WORLD, MICRO, MAX_LENGTH, SEED = 2, 3, 12, 3
LINES = [line.strip() for line in open(CORPUS, encoding="utf-8") if line.strip()][:20]



def env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "DS_ACCELERATOR": "cpu"}


def accum(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env())


def write_config(path, out, args: dict, schedule, unit="epoch", epochs=3, **distributed) -> str:
    cfg = {
        "run": {"output_dir": str(out), "seed": SEED, "epochs": epochs},
        "task": {"target": "builtin:hf_causal_lm", "args": args},
        "data": {"micro_batch_size": MICRO, "shuffle": True},
        "accumulation": {"schedule": schedule, "unit": unit},
        "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.9},
        "lr_scheduler": None,
        "distributed": {"backend": "ddp", "nproc_per_node": WORLD, **distributed},
        "logging": {"progress": "plain"},
    }
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def make_model_dir(path) -> str:
    """A local model directory with config.json and a tokenizer, no weights: a fresh init from the run seed."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.save_pretrained(path)
    GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None).save_pretrained(path)
    return str(path)


def brute_factor(schedule: dict, value: int) -> int:
    return schedule[max(k for k in schedule if k <= value)]


def reference(model, train: list, schedule: dict, unit: str, epochs: int):
    """Plain torch, one process: each window = every rank's micro-batches of it (torch's DistributedSampler shards),
    each sample run alone without padding, the loss the mean over every real next-token target of the window."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    tokens, per_epoch = 0, []
    for epoch in range(epochs):
        shards = launcher_shards(train, WORLD, MICRO, epoch, seed=SEED)
        n, start, counted = len(shards[0]), 0, 0
        while start < n:
            factor = brute_factor(schedule, epoch if unit == "epoch" else tokens)
            window = [i for rank in range(WORLD) for batch in shards[rank][start:start + factor] for i in batch]
            total, count = 0.0, 0
            for i in window:
                ids = train[i][None]
                logits = model(input_ids=ids).logits[0, :-1]
                total = total + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
                count += ids.shape[1] - 1
            optimizer.zero_grad()
            (total / count).backward()
            optimizer.step()
            tokens, counted, start = tokens + count, counted + count, start + factor
        per_epoch.append(counted)
    return model.state_dict(), per_epoch


def assert_same(got: dict, want: dict, what: str) -> None:
    want = {k: v for k, v in want.items() if k in got}  # a reference module may hold extra non-persistent buffers
    assert set(got) == set(want), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=lambda m: f"{what} {key}: {m}")


def read_run(run_dir: str, proc) -> tuple[dict, list, dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return torch.load(os.path.join(run_dir, "model.pt"), weights_only=True), lines, summary


def assert_export(run_dir: str, state: dict, tokenizer: bool) -> None:
    """`output_dir/hf` opens with from_pretrained and holds exactly the weights of model.pt (and the tokenizer)."""
    hf = os.path.join(run_dir, "hf")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(hf))
    loaded = AutoModelForCausalLM.from_pretrained(hf)
    assert loaded.dtype == torch.float32
    exported = loaded.state_dict()
    assert set(exported) == set(state)
    assert all(torch.equal(exported[k], state[k]) for k in state)
    assert os.path.isfile(os.path.join(hf, "tokenizer.json")) == tokenizer
    if tokenizer:
        assert AutoTokenizer.from_pretrained(hf)("the river")["input_ids"]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """DDP: a model directory without weights (fresh init from the seed), its tokenizer by default, a text file,
    pieces of at most MAX_LENGTH tokens, a fifth held out, a growing factor with partial windows."""
    tmp = tmp_path_factory.mktemp("hf")
    model_dir = make_model_dir(tmp / "model")
    data = tmp / "corpus.txt"
    data.write_text("\n".join(LINES) + "\n\n")
    args = {"model": model_dir, "data": str(data), "max_length": MAX_LENGTH, "val_fraction": 0.2}
    schedule = {0: 1, 1: 2, 2: 4}
    proc = accum("run", write_config(tmp / "ddp.yaml", tmp / "ddp", args, schedule))
    return tmp, args, schedule, str(tmp / "ddp"), proc


def test_ddp_run_equals_per_token_reference_and_exports(ddp_run):
    tmp, args, schedule, run_dir, proc = ddp_run
    state, lines, summary = read_run(run_dir, proc)
    # the task's samples, checked against the tokenizer directly: every line cut into pieces of <= MAX_LENGTH ids
    torch.manual_seed(SEED)
    task = hf_causal_lm(**args)
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    pieces = [ids[i:i + MAX_LENGTH] for ids in tokenizer(LINES)["input_ids"] for i in range(0, len(ids), MAX_LENGTH)]
    want = sorted(tuple(p) for p in pieces if len(p) >= 2)
    assert any(len(ids) > MAX_LENGTH for ids in tokenizer(LINES)["input_ids"])  # some lines are really cut
    assert sorted(tuple(s.tolist()) for s in task["dataset"] + task["val_dataset"]) == want
    assert len(task["val_dataset"]) == round(0.2 * len(want))
    lengths = {len(s) for s in task["dataset"]}
    assert len(lengths) > 3  # variable lengths: padding is really there to exclude

    torch.manual_seed(SEED)  # the worker seeds, then builds the model from config.json alone
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args["model"]))
    want_state, tokens_per_epoch = reference(model, task["dataset"], schedule, "epoch", 3)
    assert_same(state, want_state, "DDP vs per-token reference")

    batches = math.ceil(math.ceil(len(task["dataset"]) / WORLD) / MICRO)  # micro-batches per rank per epoch
    for epoch, factor in enumerate((1, 2, 4)):
        rows = [r for r in lines if r["epoch"] == epoch]
        assert {r["factor"] for r in rows} == {factor} and len(rows) == math.ceil(batches / factor)
        assert sum(r["elements"] for r in rows) == tokens_per_epoch[epoch]  # real targets: no padding, no -100
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert summary["elements"] == sum(tokens_per_epoch)
    assert_export(run_dir, state, tokenizer=True)


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed (pip install -e .[deepspeed])")
@pytest.mark.slow
def test_deepspeed_zero2_from_export_equals_reference(ddp_run):
    """ZeRO-2 with the shipped JSON as it is, from the DDP run's export (weights + tokenizer), JSON-lines data with
    its own text field, a token-keyed schedule (count_fn plans the steps before training)."""
    tmp, _, _, ddp_dir, ddp_proc = ddp_run
    assert ddp_proc.returncode == 0
    export = os.path.join(ddp_dir, "hf")
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": i, "body": line}) + "\n" for i, line in enumerate(LINES)))
    args = {"model": export, "data": str(data), "text_field": "body", "max_length": MAX_LENGTH}
    schedule = {0: 1, 150: 2, 400: 3}
    proc = accum("run", write_config(tmp / "ds.yaml", tmp / "ds", args, schedule, unit="tokens", backend="deepspeed",
                                     deepspeed_config=os.path.join(ROOT, "configs", "ds_zero2.json")))
    state, lines, summary = read_run(str(tmp / "ds"), proc)
    task = hf_causal_lm(**args)
    assert task["val_dataset"] is None
    want_state, tokens_per_epoch = reference(AutoModelForCausalLM.from_pretrained(export), task["dataset"], schedule,
                                             "tokens", 3)
    assert_same(state, want_state, "DeepSpeed ZeRO-2 vs per-token reference")
    assert {r["factor"] for r in lines} == {1, 2, 3}
    assert summary["backend"] == "deepspeed" and summary["elements"] == sum(tokens_per_epoch)
    planned = int(re.search(r"(\d+) optimizer steps, schedule", proc.stdout).group(1))
    assert planned == summary["optimizer_steps"] == len(lines)  # count_fn's plan of a token-keyed schedule
    assert_export(str(tmp / "ds"), state, tokenizer=True)


# -- inputs -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_datasets_directory_and_byte_level_ids(tmp_path):
    """A save_to_disk directory gives the same samples as the text file; with no tokenizer, ids are UTF-8 bytes."""
    import datasets

    datasets.Dataset.from_dict({"text": LINES[:6]}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "lines.txt").write_text("\n".join(LINES[:6]))
    model = {"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 8, "n_layer": 1, "n_head": 2}
    from_disk = hf_causal_lm(model=model, data=str(tmp_path / "ds"), max_length=64)
    from_text = hf_causal_lm(model=model, data=str(tmp_path / "lines.txt"), max_length=64)
    encoded = [line.encode("utf-8") for line in LINES[:6]]
    want = [torch.tensor(list(b[i:i + 64])) for b in encoded for i in range(0, len(b), 64) if len(b[i:i + 64]) >= 2]
    for got in (from_disk["dataset"], from_text["dataset"]):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    batch = from_text["collate_fn"](from_text["dataset"][:3])
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["labels"][real], batch["input_ids"][real]) and (batch["labels"][~real] == -100).all()
    assert from_text["count_fn"](batch) == sum(len(s) - 1 for s in from_text["dataset"][:3])
    loss_sum, count = from_text["loss_fn"](from_text["model"], batch)
    assert int(count) == from_text["count_fn"](batch) and loss_sum.ndim == 0
    assert from_text["model"]._no_split_modules  # FSDP's auto wrap finds the blocks on the model itself


def bad_config(tmp_path, **args) -> str:
    base = {"model": {"model_type": "gpt2", "vocab_size": 256}, "data": CORPUS}
    return write_config(tmp_path / "bad.yaml", tmp_path / "bad", {**base, **args}, {0: 1})


BAD = [
    ("model", {"model": "no/such/model"}, "task.args.model", "'no/such/model' not found"),
    ("no-config", {"model": os.path.join(ROOT, "launcher")}, "task.args.model", "has no config.json"),
    ("no-type", {"model": {"n_layer": 1}}, "task.args.model.model_type", "is missing"),
    ("tokenizer", {"tokenizer": "no/such/tokenizer"}, "task.args.tokenizer", "not found"),
    ("data", {"data": "no/such/corpus.txt"}, "task.args.data", "'no/such/corpus.txt' not found"),
    ("data-dir", {"data": os.path.join(ROOT, "configs")}, "task.args.data", "not written by datasets' save_to_disk"),
    ("field", {"data": "JSONL", "text_field": "text"}, "task.args.text_field", "'text' is not a field"),
    ("unknown", {"max_lenght": 64}, "task.args.max_lenght", "did you mean 'max_length'?"),
    ("fraction", {"val_fraction": 1.0}, "task.args.val_fraction", "in [0, 1)"),
]


@pytest.mark.parametrize("name,args,field,words", BAD, ids=[b[0] for b in BAD])
def test_bad_args_are_one_line_before_launch(tmp_path, capsys, name, args, field, words):
    if args.get("data") == "JSONL":
        (tmp_path / "rows.jsonl").write_text(json.dumps({"body": "a line"}) + "\n")
        args = {**args, "data": str(tmp_path / "rows.jsonl")}
    code = cli_main(["run" if name == "model" else "check", bad_config(tmp_path, **args)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {field}: ") and "\n" not in err and words in err, err
    assert not os.path.exists(tmp_path / "bad")  # nothing launched, no run directory


def test_errors_found_only_when_building_name_the_arg(tmp_path):
    """What needs transformers is checked on the workers at start, still as a ConfigError naming the argument."""
    tiny = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2}
    cases = [
        ({"model": {"model_type": "no-such-model"}}, "task.args.model"),
        ({"model": {**tiny, "vocab_size": 100}}, "task.args.model"),  # bytes need 256 ids
        ({"model": {**tiny, "n_positions": 16}, "max_length": 32}, "task.args.max_length"),
    ]
    for args, field in cases:
        with pytest.raises(ConfigError) as info:
            hf_causal_lm(**{"data": CORPUS, **args})
        assert info.value.field == field, info.value.line()


def test_check_of_hf_config_never_imports_torch():
    probe = ("import sys; from launcher.cli import main; assert main(['check', 'configs/hf_tiny.yaml']) == 0; "
             "assert not {'torch', 'transformers', 'datasets'} & set(sys.modules), 'imported'")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env())
    assert proc.returncode == 0, proc.stderr[-2000:]
