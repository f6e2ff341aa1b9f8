"""accum_sched/stop_poll.py on its own: a stop asked on one rank is seen on every rank at the same poll, one poll
later, and nothing stays in flight after drain(); in one process the flag is read directly. Two real gloo ranks,
counted with the tests' own collective counter."""
from __future__ import annotations

import json
import os

from counters import CollectiveCounter
from distributed import spawn


def test_one_process_reads_the_request_directly():
    from accum_sched.stop_poll import StopPoll

    poll = StopPoll(1)
    assert [poll.poll(r) for r in (False, False, True)] == [False, False, True]
    assert poll.drain() is False


def _polls(rank: int, world: int, out: str) -> None:
    from accum_sched.stop_poll import StopPoll

    with CollectiveCounter() as colls:
        poll = StopPoll(world)
        answers = [poll.poll(rank == 1 and i == 3) for i in range(7)]  # rank 1 asks at poll 3 only
        drained = poll.drain()
        again = StopPoll(world)
        quiet = [again.poll(False) for _ in range(3)] + [again.drain()]
    on_side = [call for call, group in zip(colls.calls, colls.groups) if group == "other"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"answers": answers, "drained": drained, "quiet": quiet, "side": on_side,
                   "world": [call for call, group in zip(colls.calls, colls.groups) if group == "world"]}, f)


def test_a_request_on_one_rank_stops_every_rank_at_the_same_poll(tmp_path):
    spawn(_polls, 2, str(tmp_path), deadline_s=120)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # asked at poll 3, its sum is read at poll 4 on both ranks; no poll is started once it is True
        assert got["answers"] == [False] * 4 + [True] + [False, False], (rank, got)
        assert got["drained"] is False and got["quiet"] == [False] * 4, (rank, got)
        # one one-number all-reduce on the side group per poll that did not answer True (4 + 2 after it, then 3
        # quiet ones), none on the training group
        assert got["side"] == [["all_reduce", 1]] * (4 + 2 + 3) and got["world"] == [], (rank, got)


def _polls_every(rank: int, world: int, out: str) -> None:
    from accum_sched.stop_poll import StopPoll

    with CollectiveCounter() as colls:
        poll = StopPoll(world, every=3)
        # rank 1 asks at call 4, a call that does not communicate: the request waits for call 5
        answers = [poll.poll(rank == 1 and i == 4) for i in range(12)]
        drained = poll.drain()
    with open(os.path.join(out, f"every{rank}.json"), "w") as f:
        json.dump({"answers": answers, "drained": drained,
                   "side": [call for call, group in zip(colls.calls, colls.groups) if group == "other"]}, f)


def test_a_poll_every_three_calls_communicates_once_per_three_and_stops_every_rank_together(tmp_path):
    spawn(_polls_every, 2, str(tmp_path), deadline_s=120)
    for rank in range(2):
        got = json.loads((tmp_path / f"every{rank}.json").read_text())
        # communicating calls 2, 5, 8, 11: the request (call 4) is sent at 5 and read at 8 on both ranks, 4 calls
        # after it (at most 2 x 3); after the True answer the poll starts again at 11, with nothing asked
        assert got["answers"] == [False] * 8 + [True] + [False] * 3, (rank, got)
        assert got["drained"] is False, (rank, got)
        assert got["side"] == [["all_reduce", 1]] * 3, (rank, got)  # started at calls 2, 5 and 11


def _engine_stops(rank: int, world: int, out: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cases
    from accum_sched import AccumulationEngine

    case = cases.Case("one-window", {0: 16}, epochs=1, samples=(64,))  # 16 micro-batches, one window: no boundary
    report = {}
    for every in (1, 3):  # before the stop, so only the poll can carry it
        model = cases.make_model(case)
        engine = AccumulationEngine(DDP(model), cases.make_optimizer(case, model), case.schedule,
                                    stop_at="micro_batch", stop_poll_every=every)
        loss_fn = cases.loss_fn_for(case.kind)
        with CollectiveCounter() as colls:
            for index, batch in enumerate(engine.micro_batches(cases.rank_batches(case, rank, 0), 0)):
                engine.backward(*loss_fn(engine.model, batch))
                if rank == 1 and index == 4:
                    engine.request_stop()
        side = [call for call, group in zip(colls.calls, colls.groups) if group == "other"]
        report[every] = {"stopped_after": engine.micro_in_epoch, "should_stop": engine.should_stop,
                         "open": engine.window_open, "polls": len(side), "steps": engine.optimizer_steps}
        torch.distributed.barrier()
    with open(os.path.join(out, f"engine{rank}.json"), "w") as f:
        json.dump(report, f)


def test_the_engine_with_stop_poll_every_stops_every_rank_at_the_same_micro_batch_within_2k(tmp_path):
    spawn(_engine_stops, 2, str(tmp_path), deadline_s=180)
    for rank in range(2):
        got = json.loads((tmp_path / f"engine{rank}.json").read_text())
        # asked during micro-batch 5 (index 4): every 1 polls at each micro-batch, sends it at 5 and reads it at 6;
        # every 3 polls at 3, 6, 9: sends it at 6, reads it at 9; both inside the open window, no step taken
        assert got["1"] == {"stopped_after": 6, "should_stop": True, "open": True, "polls": 5, "steps": 0}, got
        assert got["3"] == {"stopped_after": 9, "should_stop": True, "open": True, "polls": 2, "steps": 0}, got


def test_stop_poll_every_must_be_a_positive_int():
    import pytest
    import torch

    from accum_sched import AccumulationEngine

    model = torch.nn.Linear(2, 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stop_poll_every"):
            AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), stop_poll_every=bad)


def _engine_stops_near_a_boundary(rank: int, world: int, out: str) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cases
    from accum_sched import AccumulationEngine

    case = cases.Case("factor-4", {0: 4}, epochs=1, samples=(64,))  # 16 micro-batches: windows of 4
    report = {}
    for asked_at in (1, 2):  # the window's second micro-batch, or its last but one
        model = cases.make_model(case)
        engine = AccumulationEngine(DDP(model), cases.make_optimizer(case, model), case.schedule,
                                    stop_at="micro_batch")
        loss_fn = cases.loss_fn_for(case.kind)
        with CollectiveCounter() as colls:
            for index, batch in enumerate(engine.micro_batches(cases.rank_batches(case, rank, 0), 0)):
                engine.backward(*loss_fn(engine.model, batch))
                if rank == 1 and index == asked_at:
                    engine.request_stop()
        side = [call for call, group in zip(colls.calls, colls.groups) if group == "other"]
        report[asked_at] = {"stopped_after": engine.micro_in_epoch, "open": engine.window_open, "polls": len(side),
                            "steps": engine.optimizer_steps, "should_stop": engine.should_stop}
        torch.distributed.barrier()
    with open(os.path.join(out, f"near{rank}.json"), "w") as f:
        json.dump(report, f)


def test_no_poll_is_started_whose_answer_the_boundary_gives_sooner(tmp_path):
    """Windows of 4: polls start at a window's first and second micro-batches only (the third's answer would come
    after the fourth, whose window numbers carry the flag; the fourth, the boundary, polls nothing). A request at
    the second stops every rank inside the window after the third; at the third, the boundary carries it and every
    rank stops after the window's step."""
    spawn(_engine_stops_near_a_boundary, 2, str(tmp_path), deadline_s=180)
    for rank in range(2):
        got = json.loads((tmp_path / f"near{rank}.json").read_text())
        assert got["1"] == {"stopped_after": 3, "open": True, "polls": 2, "steps": 0, "should_stop": True}, got
        assert got["2"] == {"stopped_after": 4, "open": False, "polls": 2, "steps": 1, "should_stop": True}, got


def _floored(rank: int, world: int, out: str) -> None:
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import cases
    from accum_sched import AccumulationEngine

    # one epoch of 24 micro-batches per rank in windows of 4, each micro-batch made to take >= 20 ms
    case = cases.Case("factor-4", {0: 4}, epochs=1, samples=(96,))
    plain = cases.loss_fn_for(case.kind)

    def slow_loss(model, batch):
        time.sleep(0.02)
        return plain(model, batch)

    report = {}
    for name, min_ms, asked_at in (("floor", 1000.0, 9), ("under", 1.0, 9), ("whole", 1000.0, None)):
        model = cases.make_model(case)
        engine = AccumulationEngine(DDP(model), cases.make_optimizer(case, model), case.schedule,
                                    stop_at="micro_batch", stop_poll_min_ms=min_ms)
        every = []
        engine.on_step(lambda info, engine=engine, every=every: every.append(engine._stop_poll.every))
        with CollectiveCounter() as colls:
            for index, batch in enumerate(engine.micro_batches(cases.rank_batches(case, rank, 0), 0)):
                engine.backward(*slow_loss(engine.model, batch))
                if rank == 1 and index == asked_at:  # the third window's second micro-batch
                    engine.request_stop()
        side = [call for call, group in zip(colls.calls, colls.groups) if group == "other"]
        report[name] = {"stopped_after": engine.micro_in_epoch, "open": engine.window_open, "polls": len(side),
                        "steps": engine.optimizer_steps, "every": every,
                        "params": [p.tolist() for p in cases.params(model)]}
        torch.distributed.barrier()
    with open(os.path.join(out, f"floor{rank}.json"), "w") as f:
        json.dump(report, f)


def test_a_time_floor_polls_fast_micro_batches_less_and_stops_at_the_boundary(tmp_path):
    """stop_poll_min_ms on 2 gloo ranks, micro-batches of >= 20 ms in windows of 4: with a 1000 ms floor the first
    window polls as stop_poll_every says (2 polls: no time is known yet), then every rank derives the same larger
    ``every`` from the window's summed times (between 4 and 50: a micro-batch takes 20 ms to 250 ms here) and no
    window polls again; a stop asked in the third window lands at its boundary, after its step. With a 1 ms floor
    (micro-batches slower than it) nothing changes: 2 polls per window, the stop lands inside the window. An
    uninterrupted floored run ends allclose to the plain-torch large-batch reference on every rank."""
    import torch

    import cases

    spawn(_floored, 2, str(tmp_path), deadline_s=240)
    got = [json.loads((tmp_path / f"floor{rank}.json").read_text()) for rank in range(2)]
    for rank in range(2):
        floor, under, whole = got[rank]["floor"], got[rank]["under"], got[rank]["whole"]
        assert {k: floor[k] for k in ("stopped_after", "open", "polls", "steps")} == {
            "stopped_after": 12, "open": False, "polls": 2, "steps": 3}, (rank, floor)
        assert all(4 <= k <= 50 for k in floor["every"]), (rank, floor["every"])
        assert floor["every"] == got[0]["floor"]["every"], "the ranks derived different polls"
        assert {k: under[k] for k in ("stopped_after", "open", "polls", "steps")} == {
            "stopped_after": 11, "open": True, "polls": 6, "steps": 2}, (rank, under)
        assert under["every"] == [1, 1], (rank, under["every"])
        assert whole["polls"] == 2 and whole["steps"] == 6 and len(whole["every"]) == 6, (rank, whole)
        case = cases.Case("factor-4", {0: 4}, epochs=1, samples=(96,))
        for p, r in zip(whole["params"], cases.params(cases.reference(case, 2))):
            assert torch.allclose(torch.tensor(p), r, atol=1e-6), rank


def test_stop_poll_min_ms_must_be_a_number_at_least_0():
    import pytest
    import torch

    from accum_sched import AccumulationEngine

    model = torch.nn.Linear(2, 1)
    for bad in (-1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="stop_poll_min_ms"):
            AccumulationEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), stop_poll_min_ms=bad)


def _polls_in_windows(rank: int, world: int, out: str) -> None:
    from accum_sched.stop_poll import StopPoll

    report = {}
    for size in (4, 5, 8):
        with CollectiveCounter() as colls:
            poll = StopPoll(world, every=2)
            for _ in range(3):  # three windows of `size`, as the engine calls it (left: micro-batches after this one)
                for j in range(size):
                    assert poll.poll(False, size - 1 - j) is False
            assert poll.drain() is False
        report[size] = len([c for c, group in zip(colls.calls, colls.groups) if group == "other"])
    with open(os.path.join(out, f"windows{rank}.json"), "w") as f:
        json.dump(report, f)


def test_each_window_counts_its_polls_afresh(tmp_path):
    """every=2: a window's polls sit at its 2nd, 4th, ... micro-batch and only those answered before its last start;
    windows of 4 start none (the 2nd's answer would come at the 4th, the boundary), windows of 5 one, of 8 two, in
    every window alike whatever the windows before left in the count."""
    spawn(_polls_in_windows, 2, str(tmp_path), deadline_s=120)
    for rank in range(2):
        got = json.loads((tmp_path / f"windows{rank}.json").read_text())
        assert got == {"4": 0, "5": 3, "8": 6}, (rank, got)
