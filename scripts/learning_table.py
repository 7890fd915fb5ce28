#!/usr/bin/env python3
"""Validation figures of finished runs as one Markdown table: per arm, a metric's mean ± std over
the arm's runs (seeds) at every validation step, the mean over training (each run's average over
its validation steps after the first, then mean ± std over runs) and each run's last value.

Usage:
  scripts/learning_table.py --metric val/HotpotQAVal/success \
      --arm step_gae=RUN42,RUN43,RUN44 --arm grpo=RUN42,RUN43,RUN44 [--also val/HotpotQAVal/f1]

Each RUN is a run directory (its metrics.jsonl is read). A run that lacks the metric at a step the
others have is an error naming the run and the step: the arms must share their validation steps.
"""
import argparse
import json
import math
import sys
from pathlib import Path


def metric_by_step(run: Path, metric: str, required: bool = True) -> dict:
    path = run / "metrics.jsonl"
    out = {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{line_no}: not JSON ({e})")
            if metric in row:
                out[int(row["step"])] = float(row[metric])
    if not out and required:
        sys.exit(f"{path}: no row holds {metric}")
    return out


def mean_std(xs):
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def parse_arm(text: str):
    label, _, runs = text.partition("=")
    if not label or not runs:
        sys.exit(f"--arm {text!r}: expected LABEL=RUN[,RUN...]")
    return label, [Path(r) for r in runs.split(",") if r]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metric", required=True)
    ap.add_argument("--arm", action="append", required=True, type=parse_arm)
    ap.add_argument("--also", action="append", default=[],
                    help="another metric whose last value (mean ± std over the runs that "
                         "logged it) gets a column")
    args = ap.parse_args()

    curves = {label: [metric_by_step(r, args.metric) for r in runs] for label, runs in args.arm}
    steps = sorted(next(iter(curves.values()))[0])
    for label, runs in args.arm:
        for run, curve in zip(runs, curves[label]):
            missing = [s for s in steps if s not in curve]
            if missing:
                sys.exit(f"{run}: no {args.metric} at step(s) {missing}")

    head = ["arm", "runs"] + [f"step {s}" for s in steps] + ["over training", "last, per run"] + \
        [f"{m} (last)" for m in args.also]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 2 + "--:|" * (len(steps) + 1) + "---|" + "--:|" * len(args.also))
    for label, runs in args.arm:
        cells = [label, str(len(runs))]
        for s in steps:
            m, sd = mean_std([c[s] for c in curves[label]])
            cells.append(f"{m:.3f} ± {sd:.3f}")
        later = steps[1:] or steps
        m, sd = mean_std([sum(c[s] for s in later) / len(later) for c in curves[label]])
        cells.append(f"{m:.3f} ± {sd:.3f}")
        cells.append(" / ".join(f"{c[steps[-1]]:.3f}" for c in curves[label]))
        for extra in args.also:
            last = [c[max(c)] for c in (metric_by_step(r, extra, False) for r in runs) if c]
            if last:
                m, sd = mean_std(last)
                cells.append(f"{m:.3f} ± {sd:.3f}" + ("" if len(last) == len(runs) else
                                                      f" ({len(last)} runs)"))
            else:
                cells.append("—")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
