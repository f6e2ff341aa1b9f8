"""accum_sched.integrations.transformers.AccumulationTrainer under torchrun (2 gloo CPU ranks, the Trainer's own DDP):
a tiny GPT-2 on padded sequences, schedule {1: 2, 2: 4} over epochs of 7 micro-batches per rank (partial windows of 1
and 3), against the plain-torch large-batch reference of tests/hf_reference.py (each sample alone, mean over every
target token of the window on all ranks); a fresh Trainer resumed from a checkpoint saved mid-epoch ends at the
same weights; the plain Trainer with its factor changed per epoch by a callback misses the reference."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hf_reference as ref

pytest.importorskip("transformers")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def results(out):
    return ref.launch("transformers_tasks.py", out, ("accum",))


@pytest.fixture(scope="module")
def later(out, results):
    """The resume (from the checkpoint the "accum" run saved in ``out``) and the plain Trainer: the slow tier."""
    return ref.launch("transformers_tasks.py", out, ("resumed", "callback"))


@pytest.fixture(scope="module")
def reference():
    return ref.reference()


def test_every_rank_matches_the_large_batch_reference(results, reference):
    params, steps = reference
    assert ref.gap({n: p for n, p in ref.make_model().named_parameters()}, params) > 1e-2  # training moved it
    assert steps == ref.total_steps() == 13
    for rank, got in enumerate(results["accum"]):
        for name, r in params.items():
            torch.testing.assert_close(got["params"][name], r, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")
        # global_step counts optimizer steps; the LR scheduler was given the exact total and decayed to 0 on it
        assert got["steps"] == got["total"] == steps
        assert got["last_lr"] == 0.0
        assert got["logged_steps"] == [5, 10]  # logging_steps=5 counts optimizer steps


def test_one_gradient_allreduce_per_optimizer_step(results):
    """42 micro-batches per rank, 13 steps: off-boundary micro-batches ran forward and backward in no_sync()."""
    for got in results["accum"]:
        assert got["allreduces"] == got["steps"] == 13


@pytest.mark.slow
def test_resume_mid_epoch_ends_at_the_uninterrupted_weights(results, later):
    for rank in range(ref.WORLD):
        resumed, full = later["resumed"][rank], results["accum"][rank]
        assert resumed["steps"] == full["steps"] == 13
        assert resumed["allreduces"] == 13 - 9  # it trained only what the checkpoint had not
        for name, p in full["params"].items():
            torch.testing.assert_close(resumed["params"][name], p, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_plain_trainer_with_a_factor_callback_misses_the_reference(later, reference):
    """The check above can fail: the Trainer whose gradient_accumulation_steps a callback mutates per epoch plans
    its LR over the first epoch's factor (21 steps where 13 are taken) and ends far from the reference."""
    params, _ = reference
    for got in later["callback"]:
        assert ref.gap(got["params"], params) > 1e-3
        assert got["total"] == 21 != got["steps"]


@pytest.mark.parametrize(("setting", "words"), [
    ({"gradient_accumulation_steps": 2}, ("gradient_accumulation_steps=2", "accumulation_schedule")),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, ("deepspeed=", "make_engine")),
    ({"fp16": True}, ("fp16=True", "bf16")),
])
def test_refused_settings_say_what_to_use(tmp_path, setting, words):
    """One ValueError line naming the setting and the fix, before anything trains."""
    from accum_sched.integrations.transformers import AccumulationTrainer
    from transformers_tasks import arguments

    if "deepspeed" in setting:
        pytest.importorskip("deepspeed")
    saved = dict(os.environ)  # TrainingArguments(deepspeed=...) sets ACCELERATE_* variables in this process, which
    try:  # every later launch in this pytest run would inherit (its Trainer would then build a DeepSpeed engine)
        with pytest.raises(ValueError) as caught:
            AccumulationTrainer(model=ref.make_model(), args=arguments(str(tmp_path), **setting),
                                train_dataset=ref.Sequences(), data_collator=ref.collate, accumulation_schedule={1: 2})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.slow
def test_documented_example_runs():
    """docs/transformers.md's example, as documented: torchrun, 2 workers; 7 micro-batches per rank and epoch at
    factors 1, 2, 4, 4 take 7 + 4 + 2 + 2 optimizer steps, the LR scheduler's total, decayed to 0."""
    root = os.path.dirname(TESTS)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "examples/hf_trainer.py"], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "optimizer steps 15, LR total 15, final lr 0" in done.stdout, done.stdout[-2000:]


@pytest.mark.slow
def test_resume_at_an_epoch_end_with_random_sampling(tmp_path):
    """One process, the Trainer's default random sampler: a checkpoint saved at the last step of epoch 0 (14
    micro-batches at factor 1) resumes at epoch 1 and ends at the uninterrupted run's weights."""
    from accum_sched.integrations.transformers import AccumulationTrainer
    from transformers_tasks import arguments

    def trainer(**overrides):
        args = arguments(str(tmp_path), train_sampling_strategy="random", **overrides)
        return AccumulationTrainer(model=ref.make_model(), args=args, train_dataset=ref.Sequences(),
                                   data_collator=ref.collate, accumulation_schedule=ref.SCHEDULE)

    full = trainer(save_strategy="steps", save_steps=14)
    full.train()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-14"))
    assert full.state.global_step == resumed.state.global_step == 14 + 7 + 4
    moved = dict(full.model.named_parameters())
    assert ref.gap(moved, {n: p for n, p in ref.make_model().named_parameters()}) > 1e-2
    for name, p in resumed.model.named_parameters():
        torch.testing.assert_close(p, moved[name], atol=1e-6, rtol=1e-5)
