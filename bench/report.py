"""Turn the per-rank records of every launch into the benchmark's tables and target verdicts (pure functions).

``records[variant]`` maps a repetition index to ``[rank0_record, rank1_record]`` (see bench/worker.py);
repetition i of every variant ran in the same interleaved round, so ratios are taken within a round (rounds where
either side has no record are left out) and then summarised as median [min-max] over rounds.
"""
from __future__ import annotations

import statistics


def _fmt_spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def throughput(rep: list[dict], epochs: list[int], samples_per_epoch: int) -> float:
    """Samples per second (both ranks' samples) of the fastest of ``epochs``, timed on rank 0.

    The fastest epoch, not the mean: other work on the machine only ever adds time, so the minimum is the
    steadiest estimate of what the loop itself costs; the spread over repetitions still shows in the table.
    """
    return samples_per_epoch / min(rep[0]["epochs"][str(e)]["seconds"] for e in epochs)


def cpu_efficiency(rep: list[dict], epochs: list[int], samples_per_epoch: int) -> float:
    """Samples per CPU second of all ranks (fastest of ``epochs``): the work done, whatever else runs."""
    return samples_per_epoch / min(sum(r["epochs"][str(e)]["cpu_seconds"] for r in rep) for e in epochs)


def per_step(rep: list[dict], epochs: list[int], key: str) -> float | None:
    """``key`` (rounds or bytes) per optimizer step over ``epochs``, from rank 0's comm-hook counts."""
    stats = [rep[0]["epochs"][str(e)] for e in epochs]
    if any(s[key] is None for s in stats):
        return None
    return sum(s[key] for s in stats) / sum(s["steps"] for s in stats)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarise(workload, records: dict, variants: dict, baseline: str, agreement: dict, skipped: dict) -> dict:
    """Numbers for one model: per factor and variant, and per variant. ``agreement[variant]`` = max |diff|."""
    samples_per_epoch = workload.micro * workload.batches * workload.world
    by_factor: dict[int, list[int]] = {}
    for epoch, factor in workload.timed_epochs():
        by_factor.setdefault(factor, []).append(epoch)
    base = records.get(baseline, {})
    out = {"factors": {}, "variants": {}}
    for factor, epochs in by_factor.items():
        rows = {}
        for name in variants:
            reps = records.get(name, {})
            if not reps:
                continue
            paired = [i for i in sorted(reps) if i in base]
            sps = [throughput(reps[i], epochs, samples_per_epoch) for i in sorted(reps)]
            ratios = [throughput(reps[i], epochs, samples_per_epoch) / throughput(base[i], epochs, samples_per_epoch)
                      for i in paired]
            cpu = [cpu_efficiency(reps[i], epochs, samples_per_epoch) / cpu_efficiency(base[i], epochs,
                                                                                        samples_per_epoch)
                   for i in paired]
            first = reps[min(reps)]
            rows[name] = {"samples_per_s": sps, "ratio": ratios, "cpu_ratio": cpu,
                          "rounds_per_step": per_step(first, epochs, "rounds"),
                          "bytes_per_step": per_step(first, epochs, "bytes")}
        out["factors"][factor] = rows
    for name in variants:
        reps = records.get(name, {})
        if not reps:
            continue
        paired = [i for i in sorted(reps) if i in base]
        peak = {i: max(r["peak_rss_mb"] for r in reps[i]) for i in reps}
        world = len(reps[min(reps)])
        out["variants"][name] = {
            "repetitions": len(reps),
            "rss_mb_per_rank": [statistics.median(reps[i][k]["peak_rss_mb"] for i in reps) for k in range(world)],
            "rss_ratio": [peak[i] / max(r["peak_rss_mb"] for r in base[i]) for i in paired],
            "first_step_s": [reps[i][0]["first_step_s"] for i in sorted(reps)],
            "agreement": agreement.get(name),
            "rounds_equal_steps": all(rep[0]["epochs"][e]["rounds"] == rep[0]["epochs"][e]["steps"]
                                      for rep in reps.values() for e in rep[0]["epochs"]),
            "imported_deepspeed": any(r["imported_deepspeed"] for rep in reps.values() for r in rep),
        }
    out["skipped"] = skipped
    return out


def render(workload, params: int, summary: dict, variants: dict, reps: int) -> str:
    """The two tables of one model: throughput per factor, then memory / start-up / agreement per variant."""
    lines = [f"model {workload.model} MLP ({params / 1e6:.2f}M parameters), micro-batch {workload.micro}, "
             f"{workload.world} ranks on gloo (CPU), {workload.batches} micro-batches per rank per epoch, "
             f"{workload.epochs_per_factor} timed epoch(s) per factor, {reps} interleaved repetitions; "
             f"schedule {workload.schedule()} (epoch 0 = warm-up). Throughput of the fastest epoch of each factor; "
             f"ratios: median [min-max] over repetitions, each against the hand-written loop of the same round; "
             f"CPU-s = CPU seconds of both ranks"]
    head = ["variant", "factor", "samples/s x hand-written", "samples/CPU-s x hand-written", "samples/s",
            "all-reduce rounds/step", "MB/step"]
    rows = []
    for factor, per_variant in summary["factors"].items():
        for name, row in per_variant.items():
            rounds = row["rounds_per_step"]
            nbytes = row["bytes_per_step"]
            rows.append([variants[name].label, str(factor), _fmt_spread(row["ratio"]), _fmt_spread(row["cpu_ratio"]),
                         f"{statistics.median(row['samples_per_s']):.0f}",
                         "n/a" if rounds is None else f"{rounds:.2f}",
                         "n/a" if nbytes is None else f"{nbytes / 2**20:.2f}"])
    lines += ["", _table(head, rows)]
    head = ["variant", "peak RSS MB rank0/rank1", "RSS x hand-written", "launch -> 1st step s",
            "max |param - reference|", "note"]
    rows = []
    for name, row in summary["variants"].items():
        agreement = row["agreement"]
        rows.append([variants[name].label, "/".join(f"{v:.0f}" for v in row["rss_mb_per_rank"]),
                     _fmt_spread(row["rss_ratio"], 3), _fmt_spread(row["first_step_s"], 1),
                     "-" if agreement is None else f"{agreement:.1e}", variants[name].note])
    for name, reason in summary["skipped"].items():
        rows.append([variants[name].label if name in variants else name, "-", "-", "-", "-", f"skipped: {reason}"])
    lines += ["", _table(head, rows)]
    return "\n".join(lines)


def verdicts(summary: dict, engine: str, baseline: str, peers: tuple[str, ...]) -> list[str]:
    """The issue's targets, each as 'MET'/'MISSED' with the number behind it."""
    out = []
    for factor, per_variant in summary["factors"].items():
        if engine not in per_variant:
            continue
        ratio = statistics.median(per_variant[engine]["ratio"])
        cpu = statistics.median(per_variant[engine]["cpu_ratio"])
        out.append(f"{'MET   ' if ratio >= 0.98 else 'MISSED'} factor {factor}: engine at {ratio:.3f}x the "
                   f"hand-written loop's samples/s (target >= 0.98; per CPU second {cpu:.3f}x)")
        for peer in peers:
            if peer in per_variant:
                theirs = statistics.median(per_variant[peer]["ratio"])
                out.append(f"{'MET   ' if ratio > theirs else 'MISSED'} factor {factor}: engine {ratio:.3f}x vs "
                           f"{peer} {theirs:.3f}x (target: ahead)")
    if engine in summary["variants"]:
        row = summary["variants"][engine]
        out.append(f"{'MET   ' if row['rounds_equal_steps'] else 'MISSED'} engine: gradient all-reduce rounds == "
                   f"optimizer steps in every epoch (target: exactly 1 per step)")
        rss = statistics.median(row["rss_ratio"])
        out.append(f"{'MET   ' if rss <= 1.05 else 'MISSED'} engine: peak RSS {rss:.3f}x the hand-written loop "
                   f"(target <= 1.05)")
        out.append(f"{'MET   ' if not row['imported_deepspeed'] else 'MISSED'} engine: deepspeed not imported "
                   f"by a DDP run")
    return out


def _collectives_per_step(rep: list[dict], epochs: list[int]) -> dict | None:
    stats = [rep[0]["epochs"][str(e)] for e in epochs]
    if any(s.get("collectives") is None for s in stats):
        return None
    steps = sum(s["steps"] for s in stats)
    return {k: sum(s["collectives"][k] for s in stats) / steps for k in stats[0]["collectives"]}


def summarise_pairs(workload, records: dict, pairs) -> dict:
    """FSDP2 rows: each engine row against its own hand-written loop (same round), with collectives per step."""
    samples_per_epoch = workload.micro * workload.batches * workload.world
    by_factor: dict[int, list[int]] = {}
    for epoch, factor in workload.timed_epochs():
        by_factor.setdefault(factor, []).append(epoch)
    out = {}
    for engine, hand in pairs:
        for name in (engine, hand):
            reps = records.get(name, {})
            if not reps:
                continue
            base = records.get(hand, {})
            rows = {}
            for factor, epochs in by_factor.items():
                paired = [i for i in sorted(reps) if i in base]
                rows[factor] = {
                    "ratio": [throughput(reps[i], epochs, samples_per_epoch) /
                              throughput(base[i], epochs, samples_per_epoch) for i in paired],
                    "samples_per_s": [throughput(reps[i], epochs, samples_per_epoch) for i in sorted(reps)],
                    "collectives": _collectives_per_step(reps[min(reps)], epochs)}
            out[name] = {"factors": rows, "baseline": hand,
                         "rss_mb_per_rank": [statistics.median(reps[i][k]["peak_rss_mb"] for i in reps)
                                             for k in range(len(reps[min(reps)]))]}
    return out


def render_pairs(summary: dict, variants: dict) -> str:
    head = ["variant", "factor", "samples/s x hand-written FSDP2", "samples/s", "all-gathers/step",
            "reduce-scatters/step", "all-reduces/step", "MB moved/step", "peak RSS MB rank0/rank1"]
    rows = []
    for name, row in summary.items():
        for factor, r in row["factors"].items():
            c = r["collectives"] or {}
            rows.append([variants[name].label, str(factor), _fmt_spread(r["ratio"]),
                         f"{statistics.median(r['samples_per_s']):.0f}",
                         *(f"{c[k]:.1f}" if k in c else "n/a" for k in ("all_gather", "reduce_scatter", "all_reduce")),
                         f"{c['bytes'] / 2**20:.2f}" if "bytes" in c else "n/a",
                         "/".join(f"{v:.0f}" for v in row["rss_mb_per_rank"])])
    title = "FSDP2 rows (each against the hand-written FSDP2 loop of the same sync mode and round)\n"
    return title + _table(head, rows)


def pair_verdicts(summary: dict, pairs) -> list[str]:
    out = []
    for engine, hand in pairs:
        if engine not in summary or hand not in summary:
            continue
        for factor, r in summary[engine]["factors"].items():
            if r["ratio"]:
                ratio = statistics.median(r["ratio"])
                out.append(f"{'MET   ' if ratio >= 0.98 else 'MISSED'} factor {factor}: {engine} at {ratio:.3f}x "
                           f"the hand-written FSDP2 loop's samples/s (target >= 0.98)")
    return out
