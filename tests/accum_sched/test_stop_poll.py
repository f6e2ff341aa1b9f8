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
