"""AccumulationSchedule: parser, lookup, step counting and table, checked against brute force (hypothesis).

Pure Python, no torch: these run in well under a second each.
"""
from __future__ import annotations

import copy
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accum_sched import AccumulationSchedule

settings.register_profile("accum", max_examples=150, deadline=None)
settings.load_profile("accum")

# {epoch: factor} as a person would write it: a few milestones, small factors.
schedules = st.dictionaries(st.integers(0, 200), st.integers(1, 64), min_size=1, max_size=6)


def brute_factor(mapping: dict[int, int], epoch: int) -> int:
    """The factor of ``epoch``: the value at the largest key <= epoch, 1 before the first key (linear scan)."""
    best = None
    for key in mapping:
        if key <= epoch and (best is None or key > best):
            best = key
    return 1 if best is None else mapping[best]


def brute_steps(mapping: dict[int, int], per_epoch: list[int]) -> int:
    """Count optimizer steps by walking every micro-batch: a step at each full window and at each epoch's end."""
    steps = 0
    for epoch, batches in enumerate(per_epoch):
        in_window = 0
        for _ in range(batches):
            in_window += 1
            if in_window == brute_factor(mapping, epoch):
                steps, in_window = steps + 1, 0
        steps += in_window > 0  # the partial last window is stepped, never carried over
    return steps


def as_text(mapping: dict[int, int], sep: str = ",") -> str:
    return sep.join(f"{k}:{f}" for k, f in mapping.items())


def assert_names_entry(exc: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(exc.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    # what is wrong, then how to fix it ("...; use ..."), or the rule it breaks ("must be an integer >= 1")
    assert "; " in message or "must be" in message, f"no hint on how to fix it: {message}"


# -- accepted forms -----------------------------------------------------------------------------------------------

@given(schedules, st.randoms())
def test_mapping_string_and_json_forms_round_trip(mapping, rnd):
    items = list(mapping.items())
    rnd.shuffle(items)  # order of entries does not matter
    shuffled = dict(items)
    from_mapping = AccumulationSchedule(shuffled)
    assert from_mapping.to_dict() == mapping
    assert list(from_mapping.to_dict()) == sorted(mapping)
    assert AccumulationSchedule(as_text(shuffled)) == from_mapping
    assert AccumulationSchedule(" ; ".join(f" {k} : {f} " for k, f in items)) == from_mapping
    assert AccumulationSchedule({str(k): f for k, f in items}) == from_mapping  # JSON gives string keys
    assert AccumulationSchedule(as_text(from_mapping.to_dict())) == from_mapping  # its own text reads back
    assert AccumulationSchedule(from_mapping) == from_mapping
    assert AccumulationSchedule(as_text(mapping)).fingerprint() == from_mapping.fingerprint()


@given(st.integers(1, 10_000))
def test_int_and_digit_string_are_a_constant_factor(n):
    for spec in (n, str(n), {0: n}, f"0:{n}"):
        schedule = AccumulationSchedule(spec)
        assert schedule.to_dict() == {0: n}
        assert schedule.factor(0) == schedule.factor(10**6) == n


@given(schedules, st.integers(0, 300))
def test_factor_equals_brute_force_lookup(mapping, epoch):
    schedule = AccumulationSchedule(mapping)
    assert schedule.factor(epoch) == brute_factor(mapping, epoch)
    assert schedule.max_factor == max(list(mapping.values()) + [1])


@given(schedules)
def test_never_mutates_the_callers_mapping(mapping):
    json_like = {str(k): str(f) for k, f in mapping.items()}
    for spec in (mapping, json_like):
        before = copy.deepcopy(spec)
        schedule = AccumulationSchedule(spec)
        assert spec == before and list(spec) == list(before)  # same content, same order
        schedule.to_dict()[min(mapping)] = 999  # handing out a dict does not expose internals either
        assert schedule.to_dict() == mapping


def test_fingerprint_sees_differences_after_epoch_zero():
    early = AccumulationSchedule({0: 2, 5: 4})
    assert early.fingerprint() != AccumulationSchedule({0: 2, 5: 3}).fingerprint()
    assert early.fingerprint() != AccumulationSchedule({0: 2, 6: 4}).fingerprint()
    assert early.fingerprint() == AccumulationSchedule("5:4,0:2").fingerprint()


# -- rejected input: ValueError naming the entry and how to fix it ----------------------------------------------

@pytest.mark.parametrize("spec", [{}, "", "   ", ",", " ; , "])
def test_empty_schedule_is_rejected(spec):
    with pytest.raises(ValueError, match="empty") as exc:
        AccumulationSchedule(spec)
    assert_names_entry(exc)


@given(schedules, st.integers(-10**6, -1))
def test_negative_key_is_rejected(mapping, key):
    bad = {**mapping, key: 2}
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule(bad)
    assert_names_entry(exc, str(key), "negative")
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule(as_text(bad))
    assert_names_entry(exc, f"{key}:2", "negative")


@pytest.mark.parametrize("key", [True, False, 1.5, 2.0, None, "a", "1.5", "", (1,), "²", "+1", "1_0"])
def test_non_integer_or_bool_key_is_rejected(key):
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule({5: 1, key: 3})  # not key 0 or 1: False == 0 and True == 1 merge in a dict
    assert_names_entry(exc, repr(key))


@pytest.mark.parametrize("factor", [True, False, 1.0, 2.5, 0, -1, -64, None, "x", "", "²", "+2", "1_0", [2]])
def test_bad_factor_is_rejected(factor):
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule({0: 1, 3: factor})
    assert_names_entry(exc, repr(factor), "3")


@given(schedules, st.sampled_from(["0", "-1", "-64", "1.5", "2.0", "x", "", "True", "+2", "1_0", "٣", "1e3"]),
       st.data())
def test_bad_factor_in_string_form_is_rejected(mapping, factor, data):
    key = data.draw(st.sampled_from(sorted(mapping)))
    parts = [f"{k}:{f}" if k != key else f"{k}:{factor}" for k, f in mapping.items()]
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule(",".join(parts))
    assert_names_entry(exc, f"{key}:{factor}")


@given(schedules, st.integers(1, 9), st.data())
def test_duplicate_key_in_string_form_is_rejected(mapping, factor, data):
    key = data.draw(st.sampled_from(sorted(mapping)))
    text = as_text(mapping) + f",{key}:{factor}"
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule(text)
    assert_names_entry(exc, f"{key}:{factor}", "twice")
    with pytest.raises(ValueError) as exc:  # the same key spelt two ways in a mapping
        AccumulationSchedule({key: 1, str(key): factor})
    assert_names_entry(exc, "twice")


@pytest.mark.parametrize("text", ["0-1", "0:1:2", "a:b", "0:1,5", "0:1 5:2", "1.5:2", "0=1", ":2", "0:", "abc",
                                  "-3", "0:1,x", "{0: 1}"])
def test_unparseable_string_is_rejected(text):
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule(text)
    assert_names_entry(exc)
    bad_parts = [p.strip() for p in re.split("[,;]", text) if p.strip() and not _strict_entry(p)]
    if ":" in text or "," in text:
        assert any(p in str(exc.value) for p in bad_parts), (bad_parts, str(exc.value))


@pytest.mark.parametrize("spec", [None, [0, 1], (0, 1), 2.0, True, object()])
def test_unsupported_types_are_rejected(spec):
    with pytest.raises(ValueError) as exc:
        AccumulationSchedule(spec)
    assert_names_entry(exc, type(spec).__name__)


def _strict_entry(part: str):
    return re.fullmatch(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*", part)


def strict_parse(text: str):
    """What the string form means, written independently: ASCII digits only, ',' or ';' between entries."""
    body = text.strip()
    if re.fullmatch(r"[0-9]+", body):
        return {0: int(body)} if int(body) >= 1 else None
    out = {}
    for part in re.split("[,;]", body):
        if not part.strip():
            continue
        match = _strict_entry(part)
        if not match:
            return None
        key, factor = int(match[1]), int(match[2])
        if key in out or factor < 1:
            return None
        out[key] = factor
    return out or None


@given(st.text(alphabet="0123456789:,; -+._x٣²\t", max_size=14))
def test_any_string_parses_as_the_grammar_says_or_raises(text):
    expected = strict_parse(text)
    if expected is None:
        with pytest.raises(ValueError):
            AccumulationSchedule(text)
    else:
        assert AccumulationSchedule(text).to_dict() == dict(sorted(expected.items()))


# -- counting -------------------------------------------------------------------------------------------------------

@given(schedules, st.integers(0, 60), st.integers(0, 30))
def test_optimizer_steps_equals_simulation(mapping, batches, epochs):
    schedule = AccumulationSchedule(mapping)
    assert schedule.optimizer_steps(batches, epochs) == brute_steps(mapping, [batches] * epochs)


@given(schedules, st.lists(st.integers(0, 60), max_size=30))
def test_optimizer_steps_per_epoch_sequence_equals_simulation(mapping, per_epoch):
    schedule = AccumulationSchedule(mapping)
    assert schedule.optimizer_steps(per_epoch, len(per_epoch)) == brute_steps(mapping, per_epoch)
    assert schedule.optimizer_steps(tuple(per_epoch), len(per_epoch)) == brute_steps(mapping, per_epoch)
    for epoch, batches in enumerate(per_epoch):
        windows = schedule.windows(batches, epoch)
        factor = brute_factor(mapping, epoch)
        assert sum(windows) == batches and len(windows) == math.ceil(batches / factor)
        assert all(w == factor for w in windows[:-1]) and all(1 <= w <= factor for w in windows)


def test_optimizer_steps_rejects_bad_counts():
    schedule = AccumulationSchedule({0: 2})
    with pytest.raises(ValueError, match="one per epoch"):
        schedule.optimizer_steps([4, 4], 3)
    with pytest.raises(ValueError, match=">= 0"):
        schedule.optimizer_steps(-1, 3)
    with pytest.raises(ValueError, match=">= 0"):
        schedule.optimizer_steps([4, -1], 2)


def test_lightning_style_estimate_would_be_wrong():
    """The count is not batches * epochs / last factor (Lightning's estimate), nor does it drop partial windows."""
    schedule = AccumulationSchedule({0: 1, 2: 4})
    assert schedule.optimizer_steps(10, 4) == 10 + 10 + 3 + 3
    assert schedule.optimizer_steps([10, 10, 10, 1], 4) == 10 + 10 + 3 + 1


# -- the table ------------------------------------------------------------------------------------------------------

def test_table_text():
    table = AccumulationSchedule({0: 1, 5: 2, 10: 4}).table(32, world_size=2, epochs=12, batches_per_epoch=10)
    assert table.splitlines() == [
        "epoch  factor  micro  world  eff.batch  steps/epoch  steps",
        "  0-4       1     32      2         64           10     50",
        "  5-9       2     32      2        128            5     25",
        "10-11       4     32      2        256            3      6",
        "total optimizer steps over 12 epochs: 81",
    ]
    open_ended = AccumulationSchedule({3: 8}).table(16, world_size=4)
    assert open_ended.splitlines() == [
        "epoch  factor  micro  world  eff.batch",
        "  0-2       1     16      4         64",  # before the first key the factor is 1
        "   3+       8     16      4        512",
    ]


@given(schedules, st.integers(1, 40), st.integers(1, 64), st.integers(1, 8), st.integers(1, 50))
def test_table_rows_cover_every_epoch_and_total_matches(mapping, epochs, micro, world, batches):
    schedule = AccumulationSchedule(mapping)
    lines = schedule.table(micro, world, epochs=epochs, batches_per_epoch=batches).splitlines()
    covered = []
    for line in lines[1:-1]:
        span, factor, m, w, eff, per, steps = line.split()
        first, _, last = span.partition("-")
        epochs_here = list(range(int(first), int(last or first) + 1))
        covered += epochs_here
        assert all(brute_factor(mapping, e) == int(factor) for e in epochs_here)
        assert (int(m), int(w), int(eff)) == (micro, world, micro * world * int(factor))
        assert int(per) == math.ceil(batches / int(factor)) and int(steps) == int(per) * len(epochs_here)
    assert covered == list(range(epochs))
    assert lines[-1] == f"total optimizer steps over {epochs} epochs: {schedule.optimizer_steps(batches, epochs)}"
