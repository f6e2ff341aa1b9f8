"""AccumulationSchedule: which gradient-accumulation factor applies where.

Standard library only, so `accum-sched check` can use it on a login node without torch.

Semantics follow PyTorch Lightning's GradientAccumulationScheduler for the epoch unit: epochs are 0-indexed, the
factor of an epoch is the value at the largest key <= epoch, and epochs before the first key accumulate 1.
The key's *unit* is a separate attribute so that schedules keyed by optimizer steps, samples or tokens share the
parser, the lookup and the table; only the counter that is looked up differs.
"""
from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Mapping, Sequence

from accum_sched.planning import simulate_steps
from accum_sched.position import Position
from accum_sched.position import per_epoch as _per_epoch

UNITS = ("epoch", "step", "samples", "tokens")
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _digits(text: str) -> bool:
    """Plain ASCII digits. int() alone would also take '+3', '1_0' and non-ASCII digits such as '٣' or '²'."""
    return text.isascii() and text.isdigit()


def _parse_threshold(text, unit: str, entry: str) -> int:
    """An int key; digit strings (as JSON keys come) and, for samples/tokens, K/M/B/T suffixes are accepted."""
    if _is_int(text):
        value = text
    elif isinstance(text, str):
        raw = text.strip()
        mult = 1
        if raw[-1:].upper() in _SUFFIXES and unit in ("samples", "tokens"):
            mult, raw = _SUFFIXES[raw[-1].upper()], raw[:-1]
        if raw[:1] == "-" and _digits(raw[1:]):
            raise ValueError(f"schedule entry {entry}: key {raw} is negative; {unit} keys start at 0")
        whole, dot, fraction = raw.partition(".")
        if not (_digits(whole) and (not dot or (mult > 1 and _digits(fraction)))):
            hint = "use a non-negative integer"
            if unit in ("samples", "tokens"):
                hint += " with an optional K/M/B/T suffix, e.g. 250M"
            raise ValueError(f"schedule entry {entry}: key {text!r} is not a valid {unit} threshold; {hint}")
        value = (float(raw) if dot else int(raw)) * mult
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"schedule entry {entry}: key {text!r} is not a whole number of {unit}; "
                                 f"use an integer threshold")
            value = int(value)
    else:
        raise ValueError(f"schedule entry {entry}: key {text!r} must be an integer {unit}, "
                         f"not {type(text).__name__}; write e.g. {{0: 1, 5: 2}}")
    if value < 0:
        raise ValueError(f"schedule entry {entry}: key {value} is negative; {unit} keys start at 0")
    return value


def _check_increasing(pairs: list, key: int, unit: str, entry: str) -> None:
    """Step/sample/token thresholds are a ramp written in order (as Megatron's); a smaller key after a larger
    one is almost always a typo (a missing suffix), so it is refused. Epoch mappings keep Lightning's leniency."""
    if unit != "epoch" and pairs and key < pairs[-1][0]:
        raise ValueError(f"schedule entry {entry}: threshold {key} comes after {pairs[-1][0]}; "
                         f"{unit} thresholds must increase (check for a missing K/M/B/T suffix)")


def _ramp_pairs(ramp, unit: str) -> list[tuple[int, int]]:
    """A linear ramp from ``start`` to ``end`` over ``over`` units, as the thresholds where each factor begins:
    factor(v) = start + sign(end - start) * floor(|end - start| * v / over) for v < over, then ``end``."""
    if not isinstance(ramp, Mapping) or set(ramp) != {"start", "end", "over"}:
        raise ValueError("schedule ramp needs exactly start, end and over; write "
                         "{ramp: {start: 1, end: 8, over: 1000}}")
    start = _check_factor(ramp["start"], f"ramp start {ramp['start']!r}")
    end = _check_factor(ramp["end"], f"ramp end {ramp['end']!r}")
    over = _parse_threshold(ramp["over"], unit, f"ramp over {ramp['over']!r}")
    if over < 1:
        raise ValueError(f"schedule ramp: over={over} must be >= 1 {unit}")
    if start == end:
        return [(0, start)]
    step = 1 if end > start else -1
    pairs = []
    for factor in range(start, end + step, step):
        # the first v with floor(|end - start| * v / over) >= |factor - start|
        pairs.append((-(-abs(factor - start) * over // abs(end - start)), factor))
    return pairs


def _check_factor(value, entry: str) -> int:
    if isinstance(value, str) and _digits(value.strip()):
        value = int(value.strip())
    if not _is_int(value) or value < 1:
        raise ValueError(f"schedule entry {entry}: factor {value!r} must be an integer >= 1 "
                         f"(the number of micro-batches per optimizer step)")
    return value


class AccumulationSchedule:
    """A piecewise-constant gradient-accumulation factor, e.g. ``{0: 1, 5: 2, 10: 4}``.

    ``spec`` may be a mapping ``{key: factor}`` (int keys, or digit strings as JSON gives them), a string
    ``"0:1,5:2,10:4"``, an int (a constant factor), a linear ramp ``{"ramp": {"start": 1, "end": 8, "over": 1000}}``
    (the factor moves one step from start toward end every over/|end - start| units, reaching end at ``over``), or
    another AccumulationSchedule. The caller's object is never modified. ``unit`` says what the keys count: ``epoch``
    (default, 0-indexed epochs), ``step`` (optimizer steps completed), ``samples`` or ``tokens`` (consumed,
    globally); the last two accept K/M/B/T suffixes.
    """

    def __init__(self, spec, unit: str = "epoch"):
        if unit not in UNITS:
            raise ValueError(f"schedule unit {unit!r} is unknown; use one of {', '.join(UNITS)}")
        if isinstance(spec, AccumulationSchedule):
            unit, pairs = spec.unit, list(spec.milestones)
        else:
            pairs = self._pairs(spec, unit)
        self.unit = unit
        pairs.sort()
        self._keys = tuple(k for k, _ in pairs)
        self._factors = tuple(f for _, f in pairs)

    @staticmethod
    def _pairs(spec, unit: str) -> list[tuple[int, int]]:
        if _is_int(spec):
            return [(0, _check_factor(spec, str(spec)))]
        if isinstance(spec, str):
            text = spec.strip()
            if not text:
                raise ValueError("schedule is empty; give at least one entry such as '0:1'")
            if ":" not in text and _digits(text):
                return [(0, _check_factor(int(text), text))]
            pairs, seen = [], set()
            for part in text.replace(";", ",").split(","):
                part = part.strip()
                if not part:
                    continue
                if part.count(":") != 1:
                    raise ValueError(f"schedule entry {part!r} is not 'key:factor'; write e.g. '0:1,5:2,10:4'")
                key_text, factor_text = (s.strip() for s in part.split(":"))
                key = _parse_threshold(key_text, unit, repr(part))
                _check_increasing(pairs, key, unit, repr(part))
                if key in seen:
                    raise ValueError(f"schedule entry {part!r}: key {key} is given twice; keep one factor per key")
                seen.add(key)
                if not _digits(factor_text):
                    raise ValueError(f"schedule entry {part!r}: factor {factor_text!r} must be an integer >= 1")
                pairs.append((key, _check_factor(int(factor_text), repr(part))))
            if not pairs:
                raise ValueError("schedule is empty; give at least one entry such as '0:1'")
            return pairs
        if isinstance(spec, Mapping) and "ramp" in spec:
            if len(spec) != 1:
                raise ValueError("schedule: a ramp stands alone; write {ramp: {start: 1, end: 8, over: 1000}}")
            return _ramp_pairs(spec["ramp"], unit)
        if isinstance(spec, Mapping):
            if not spec:
                raise ValueError("schedule is empty; give at least one entry such as {0: 1}")
            pairs, seen = [], set()
            for raw_key, raw_factor in spec.items():
                entry = f"{raw_key!r}: {raw_factor!r}"
                if isinstance(raw_key, bool):
                    raise ValueError(f"schedule entry {entry}: key must be an integer, not bool")
                key = _parse_threshold(raw_key, unit, entry)
                _check_increasing(pairs, key, unit, entry)
                if key in seen:
                    raise ValueError(f"schedule entry {entry}: key {key} is given twice; keep one factor per key")
                seen.add(key)
                pairs.append((key, _check_factor(raw_factor, entry)))
            return pairs
        raise ValueError(f"schedule must be a mapping {{key: factor}}, a string like '0:1,5:2' or an int, "
                         f"not {type(spec).__name__}")

    # -- lookup -------------------------------------------------------------------------------------------------
    @property
    def milestones(self) -> tuple[tuple[int, int], ...]:
        """``((key, factor), ...)`` sorted by key."""
        return tuple(zip(self._keys, self._factors))

    def factor_at(self, value: int) -> int:
        """The factor at counter ``value`` (of this schedule's unit): the value at the largest key <= it, else 1."""
        i = bisect.bisect_right(self._keys, value) - 1
        return self._factors[i] if i >= 0 else 1

    def factor(self, epoch: int) -> int:
        """The factor of 0-indexed ``epoch`` (for an epoch-keyed schedule)."""
        if self.unit != "epoch":
            raise ValueError(f"factor(epoch) needs an epoch-keyed schedule; this one is keyed by {self.unit}: "
                             f"use factor_for(Position(...))")
        return self.factor_at(epoch)

    def factor_for(self, position: Position) -> int:
        """The factor of a window that starts at ``position``."""
        return self.factor_at(getattr(position, self.unit))

    @property
    def max_factor(self) -> int:
        return max(self._factors + (1,))

    def fingerprint(self) -> int:
        """A stable 31-bit hash of unit and milestones, so ranks can check they run the same schedule."""
        text = self.unit + ";" + ",".join(f"{k}:{f}" for k, f in self.milestones)
        return zlib.crc32(text.encode()) & 0x7FFFFFFF

    # -- counting -----------------------------------------------------------------------------------------------
    def windows(self, batches: int, epoch: int) -> list[int]:
        """Micro-batches per optimizer step in ``epoch`` of ``batches`` micro-batches; the last may be partial."""
        factor = self.factor(epoch)
        full, rest = divmod(batches, factor)
        return [factor] * full + ([rest] if rest else [])

    def optimizer_steps(self, batches_per_epoch: int | Sequence[int], epochs: int, **per_micro_step) -> int:
        """Exact optimizer steps over ``epochs`` epochs: sum of ceil(batches / factor) (partial windows step).

        ``batches_per_epoch`` is one int, or one int per epoch. Step-, sample- and token-keyed schedules are
        counted by simulation in :mod:`accum_sched.planning`; samples and tokens need
        ``samples_per_micro_step=`` / ``tokens_per_micro_step=`` (global counts per micro-step: an int or a
        function ``(epoch, index) -> int``).
        """
        if self.unit != "epoch":
            return simulate_steps(self, batches_per_epoch, epochs, **per_micro_step)
        per_epoch = _per_epoch(batches_per_epoch, epochs)
        return sum(math.ceil(n / self.factor(e)) for e, n in enumerate(per_epoch))

    # -- display ------------------------------------------------------------------------------------------------
    def ranges(self, epochs: int | None = None) -> list[tuple[int, int | None, int]]:
        """``[(first, last or None for open-ended, factor), ...]`` covering the counter from 0."""
        keys = list(self._keys)
        factors = list(self._factors)
        if not keys or keys[0] > 0:
            keys.insert(0, 0)
            factors.insert(0, 1)
        out = []
        for i, (k, f) in enumerate(zip(keys, factors)):
            last = keys[i + 1] - 1 if i + 1 < len(keys) else None
            if epochs is not None:
                if k >= epochs:
                    break
                last = epochs - 1 if last is None else min(last, epochs - 1)
            out.append((k, last, f))
        return out

    def table(self, micro_batch_size: int, world_size: int = 1, epochs: int | None = None,
              batches_per_epoch: int | None = None) -> str:
        """A readable table: range, factor, micro-batch, world, effective batch and (if known) optimizer steps."""
        head = [self.unit, "factor", "micro", "world", "eff.batch"]
        if batches_per_epoch is not None and self.unit == "epoch":
            head += ["steps/epoch", "steps"]
        rows, total = [], 0
        for first, last, f in self.ranges(epochs):
            span = f"{first}-{last}" if last is None or last != first else f"{first}"
            if last is None:
                span = f"{first}+"
            row = [span, str(f), str(micro_batch_size), str(world_size), str(micro_batch_size * f * world_size)]
            if batches_per_epoch is not None and self.unit == "epoch":
                per = math.ceil(batches_per_epoch / f)
                count = (last - first + 1) if last is not None else None
                row += [str(per), str(per * count) if count is not None else "-"]
                total += per * count if count is not None else 0
            rows.append(row)
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows]
        if batches_per_epoch is not None and epochs is not None and self.unit == "epoch":
            lines.append(f"total optimizer steps over {epochs} epochs: {total}")
        return "\n".join(lines)

    # -- value semantics ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[int, int]:
        return dict(self.milestones)

    def __eq__(self, other) -> bool:
        return isinstance(other, AccumulationSchedule) and \
            (self.unit, self.milestones) == (other.unit, other.milestones)

    def __hash__(self) -> int:
        return hash((self.unit, self.milestones))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: {f}" for k, f in self.milestones)
        unit = "" if self.unit == "epoch" else f", unit={self.unit!r}"
        return f"AccumulationSchedule({{{body}}}{unit})"
