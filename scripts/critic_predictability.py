#!/usr/bin/env python3
"""How much of a FrozenLake batch's step returns a critic could explain, per policy version.

Reads `stepppo replay DATASET --format jsonl` (stdin or a file) and prints, for each policy
version: the Monte-Carlo step returns' variance; the tabular leave-one-out ceiling the trainer
logs (`critic/vf_explained_var_ceiling`: each step predicted by the mean return of the other
steps of its group from the same state, on the rows another row shares); and a hand-made critic
that reads the render's own state summary (distance to the goal from the `Goal:` lines, the
number of goal directions, the adjacent holes) fitted by least squares, in-sample and fitted on
the previous version's batch then scored on this one (what a critic refitted after each update
faces: new maps, a moved policy). Needs numpy.

    stepppo replay RUN/dataset --format jsonl | python3 scripts/critic_predictability.py --gamma 0.95
"""
import argparse
import collections
import json
import re
import sys

import numpy as np

GOAL_LINE = re.compile(r"^(Left|Right|Up|Down) (\d+)$", re.M)


def explained_variance(pred, y):
    var = np.var(y)
    return float("nan") if var == 0 else 1.0 - np.var(y - pred) / var


def state_features(observation):
    """One-hot distance to the goal (0..7+), goal directions, adjacent holes, a bias."""
    goal = GOAL_LINE.findall(observation)
    distance = min(sum(int(n) for _, n in goal), 7)
    holes = sum(1 for line in observation.split("\n") if line.endswith(": hole"))
    x = np.zeros(11)
    x[distance] = 1.0
    x[8], x[9], x[10] = len(goal), holes, 1.0
    return x


def step_returns(lines, gamma):
    """Each policy version's closed step records with their Monte-Carlo step returns, in
    trajectory and step order: {version: [(record, return), ...]}."""
    trajectories = collections.defaultdict(list)
    for line in lines:
        r = json.loads(line)
        if r.get("open") or r.get("incomplete"):
            continue
        trajectories[(r["policy_version"], r["traj_id"])].append(r)
    out = collections.defaultdict(list)
    for (version, _), steps in trajectories.items():
        steps.sort(key=lambda r: r["step_index"])
        g, returns = 0.0, []
        for r in reversed(steps):
            g = r["reward"] + gamma * g
            returns.append(g)
        out[version].extend(zip(steps, reversed(returns)))
    return out


def batches(lines, gamma):
    """{version: [(hand-made features, return, anchor key), ...]}."""
    return {
        version: [
            (state_features(r["info"]["observation_text"]), g, (r["group_id"], r["state_hash"]))
            for r, g in rows
        ]
        for version, rows in step_returns(lines, gamma).items()
    }


def tabular_ceiling(rows):
    sums = collections.defaultdict(lambda: [0.0, 0])
    for _, g, key in rows:
        sums[key][0] += g
        sums[key][1] += 1
    pred, y = [], []
    for _, g, key in rows:
        total, n = sums[key]
        if n >= 2:
            pred.append((total - g) / (n - 1))
            y.append(g)
    return explained_variance(np.array(pred), np.array(y)) if len(y) >= 2 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("jsonl", nargs="?", help="replay output (default: stdin)")
    ap.add_argument("--gamma", type=float, default=0.95)
    args = ap.parse_args()
    lines = open(args.jsonl) if args.jsonl else sys.stdin
    data = batches(lines, args.gamma)
    print("version rows return_var tabular_ceiling handmade_in_sample handmade_prev_to_this")
    previous = None
    for version in sorted(data):
        rows = data[version]
        x = np.array([f for f, _, _ in rows])
        y = np.array([g for _, g, _ in rows])
        w = np.linalg.lstsq(x, y, rcond=None)[0]
        carried = float("nan")
        if previous is not None:
            carried = explained_variance(x @ previous, y)
        print(
            f"{version} {len(y)} {np.var(y):.3f} {tabular_ceiling(rows):.2f} "
            f"{explained_variance(x @ w, y):.2f} {carried:.2f}"
        )
        previous = w


if __name__ == "__main__":
    main()
