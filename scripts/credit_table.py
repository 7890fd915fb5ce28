#!/usr/bin/env python3
"""Why one credit assignment beats another, from the runs of scripts/paired_runs.sh: per arm (mean
over seeds), read from each run's credit.jsonl (the value, return and advantage the trainer used
for every step it learned from, the value read before the critic was fitted on that batch, so
held out from it):

- the critic's explained variance 1 - Var(R - V) / Var(R), pooled over the steps of the last
  LAST updates, and by turn index (turns 0, 1, ..., then the rest pooled), for arms whose values
  are not all zero (arms without a critic are left out of these columns);
- the variance of the step advantages before whitening (each update's `advantage/raw_var` in
  metrics.jsonl: the estimator's own spread; whitening makes every batch's 1), mean over windows
  of updates (1-10, 11-20, ...): the same updates for every arm, so "at equal steps". GRPO-style
  estimators normalise within groups, so theirs measure a different scale than GAE's R - V.

Then whether the arms' order by final score (scripts/paired_table.py) follows them is for the
reader; this prints the columns side by side.

Usage: scripts/credit_table.py OUT_DIR [--last 20] [--turns 8] [--window 10]
"""
import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def read_rows(path):
    rows = {}
    with open(path) as f:
        for line in f:
            if line.endswith("\n") and line.strip():
                row = json.loads(line)
                rows[(row["traj_id"], row["step_index"])] = row  # a later row replaces
    return list(rows.values())


def explained_variance(rows):
    rows = [r for r in rows if r["value"] is not None and r["return"] is not None]
    if len(rows) < 2:
        return None
    returns = [r["return"] for r in rows]
    residuals = [r["return"] - r["value"] for r in rows]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1)
    total = var(returns)
    return None if total == 0 else 1.0 - var(residuals) / total


def mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def fmt(x):
    return "—" if x is None else f"{x:.3f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--last", type=int, default=20, help="updates pooled for the critic's EV")
    p.add_argument("--turns", type=int, default=8, help="turn indices shown one by one")
    p.add_argument("--window", type=int, default=10, help="updates per advantage-variance window")
    a = p.parse_args()

    runs = defaultdict(dict)  # arm -> seed -> rows
    for path in sorted(a.out.glob("*-*/credit.jsonl")):
        arm, _, seed = path.parent.name.rpartition("-")
        if seed.isdigit():
            runs[arm][int(seed)] = read_rows(path)
    if not runs:
        raise SystemExit(f"{a.out}: no ARM-SEED/credit.jsonl")

    ev_rows, var_rows, windows = [], [], set()
    for arm, seeds in sorted(runs.items()):
        pooled, by_turn, by_window = [], defaultdict(list), defaultdict(list)
        has_critic = any(r["value"] not in (None, 0.0) for rows in seeds.values() for r in rows)
        for rows in seeds.values():
            last = max((r["learner_version"] for r in rows), default=0)
            recent = [r for r in rows if r["learner_version"] > last - a.last]
            if has_critic:
                pooled.append(explained_variance(recent))
                for t in range(a.turns + 1):
                    turn_rows = [r for r in recent
                                 if (r["step_index"] == t if t < a.turns else r["step_index"] >= t)]
                    by_turn[t].append(explained_variance(turn_rows))
        for seed in seeds:
            groups = defaultdict(list)
            with open(a.out / f"{arm}-{seed}" / "metrics.jsonl") as f:
                for line in f:
                    m = json.loads(line) if line.strip() else {}
                    if "advantage/raw_var" in m and "step" in m:
                        groups[(m["step"] - 1) // a.window].append(m["advantage/raw_var"])
            for w, vs in groups.items():
                by_window[w].append(mean(vs))
                windows.add(w)
        if has_critic:
            ev_rows.append((arm, len(seeds), mean(pooled), [mean(by_turn[t]) for t in range(a.turns + 1)]))
        var_rows.append((arm, len(seeds), {w: mean(v) for w, v in by_window.items()}))

    turns = [str(t) for t in range(a.turns)] + [f"≥{a.turns}"]
    print(f"Critic explained variance, last {a.last} updates (values read before fitting on their batch)\n")
    print("| arm | seeds | pooled | " + " | ".join(f"turn {t}" for t in turns) + " |")
    print("|" + "-|" * (3 + len(turns)))
    for arm, n, pooled, turn_evs in ev_rows:
        print(f"| {arm} | {n} | {fmt(pooled)} | " + " | ".join(fmt(x) for x in turn_evs) + " |")
    ws = sorted(windows)
    print(f"\nVariance of the step advantages before whitening, by window of {a.window} updates\n")
    print("| arm | seeds | " + " | ".join(f"{w * a.window + 1}–{(w + 1) * a.window}" for w in ws) + " |")
    print("|" + "-|" * (2 + len(ws)))
    for arm, n, by_window in var_rows:
        print(f"| {arm} | {n} | " + " | ".join(fmt(by_window.get(w)) for w in ws) + " |")


if __name__ == "__main__":
    main()
