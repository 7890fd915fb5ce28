#!/usr/bin/env python3
"""Tables of a paired comparison made by scripts/paired_runs.sh: per arm and evaluated step,
the mean greedy success (EM on search QA) over seeds with its 95 % confidence interval (Student t
over seeds), and the paired differences of the first arm minus each other arm over the seeds both
finished, with a 95 % t interval and a 95 % paired-bootstrap interval (10,000 resamples of seeds,
fixed generator seed). Every figure is read from OUT_DIR's JSON files; nothing is typed by hand.

Usage: scripts/paired_table.py OUT_DIR [--tag TAG] [--metric success] [--first step_gae]
                                        [--exclude-seeds 50,…]
(--exclude-seeds leaves out seeds whose warm start failed, to show the table with and without them.)

A difference is called beyond noise when both intervals exclude 0 over at least MIN_SEEDS (5)
seeds: with fewer, two equal differences give intervals of zero width, and a bootstrap over 3
or 4 seeds has only a handful of distinct resamples; those rows say "too few seeds". Beside each
difference, the smallest true difference the paired t test would find beyond noise 80 % of the
time with these seeds and this spread of differences, (t_0.975 + t_0.80) · sd / √n over n − 1
degrees of freedom: a "no" only rules out leads larger than that.

Then the same at equal wall time: per seed, the budget is the shortest total training time of
any arm (the sum of `time/step` in its metrics.jsonl), and each arm is scored at its last
evaluated step within that budget; with the paired differences of the first arm.

Then, for arms whose runs fit a critic, the critic's explained variance pooled over the last 20
steps of each run (1 − Σ rows · residual variance / Σ rows · return variance, from the run
directories' metrics.jsonl), mean over seeds.
"""
import argparse
import json
import math
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

# Two-sided 95 % Student t quantiles by degrees of freedom (1..30); above 30, 1.96 is close enough
# to the quantile (2.04 at 30) that the last entry is kept instead.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
       2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
       2.052, 2.048, 2.045, 2.042]


# One-sided 80 % Student t quantiles by degrees of freedom (1..30), for the power column.
T80 = [1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870,
       0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856,
       0.855, 0.855, 0.854, 0.854]


def quantile(table, n):
    """The table's quantile for n seeds (n − 1 degrees of freedom; the last entry above 30)."""
    return table[min(n - 1, len(table)) - 1] if n >= 2 else float("nan")


def t95(n):
    return quantile(T95, n)


def detectable_difference(half_width, n):
    """The difference a paired t test over n seeds finds beyond noise with 80 % power, from the
    95 % half-width of the mean difference (t95 · sd / √n)."""
    return half_width * (1 + quantile(T80, n) / t95(n))


def mean_ci(xs):
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, t95(len(xs)) * sd / math.sqrt(len(xs))


def bootstrap_ci(diffs, resamples=10_000, seed=0):
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def read_score(path, tag, metric):
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"{path}: cannot read ({e})")
    if tag is None:
        tags = {row.get("tag") for row in rows}
        if len(tags) != 1:
            sys.exit(f"{path}: tags {sorted(map(str, tags))}; name one with --tag")
        tag = tags.pop()
    for row in rows:
        if row.get("tag") == tag:
            if metric not in row:
                sys.exit(f"{path}: tag {tag} has no {metric!r}")
            return float(row[metric]), int(row.get("episodes", 0))
    sys.exit(f"{path}: no tag {tag} (tags: {[r.get('tag') for r in rows]})")


def collect(out, tag, metric, excluded=frozenset()):
    """scores[arm][step][seed] and the episodes per evaluation, without the seeds `excluded`."""
    scores = defaultdict(lambda: defaultdict(dict))
    episodes = set()
    for path in sorted(out.glob("*.json")):
        if m := re.fullmatch(r"warm_start-(\d+)\.eval\.json", path.name):
            arm, seed, step = None, int(m[1]), 0
        elif m := re.fullmatch(r"(.+)-(\d+)\.eval-(\d+)\.json", path.name):
            arm, seed, step = m[1], int(m[2]), int(m[3])
        else:
            continue
        if seed in excluded:
            continue
        score, n = read_score(path, tag, metric)
        episodes.add(n)
        if arm is None:
            scores["warm start"][0][seed] = score
        else:
            scores[arm][step][seed] = score
    # Every arm starts from its seed's warm start: step 0 is the same for all.
    for arm in list(scores):
        if arm != "warm start":
            scores[arm][0] = dict(scores["warm start"][0])
    scores.pop("warm start", None)
    return scores, episodes


def pooled_ev(metrics, last=20):
    """1 − Σ rows · residual variance / Σ rows · return variance over the last `last` updates."""
    rows = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "critic/vf_residual_var" in row:
            rows.append(row)
    rows = rows[-last:]
    total = sum(r["critic/rows"] * r["critic/return_var"] for r in rows)
    if not rows or total == 0:
        return None
    return 1 - sum(r["critic/rows"] * r["critic/vf_residual_var"] for r in rows) / total


def critic_table(out, arms, excluded):
    found = defaultdict(dict)
    for arm in arms:
        for metrics in sorted(out.glob(f"{arm}-*/metrics.jsonl")):
            seed = int(metrics.parent.name.rsplit("-", 1)[1])
            ev = None if seed in excluded else pooled_ev(metrics)
            if ev is not None:
                found[arm][seed] = ev
    if not found:
        return
    print("\nCritic explained variance pooled over each run's last 20 updates:\n")
    print("| arm | mean | per seed |")
    print("|---|--:|---|")
    for arm in arms:
        if found[arm]:
            evs = found[arm]
            per_seed = ", ".join(f"{k}: {v:.3f}" for k, v in sorted(evs.items()))
            print(f"| `{arm}` | {sum(evs.values()) / len(evs):.3f} | {per_seed} |")


def cumulative_seconds(metrics):
    """{step: training seconds through that step} from a run's `time/step` rows (a resumed run's
    repeated row of a step replaces the earlier one)."""
    per_step = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "time/step" in row and "step" in row:
            per_step[int(row["step"])] = float(row["time/step"])
    total, out = 0.0, {0: 0.0}
    for step in sorted(per_step):
        total += per_step[step]
        out[step] = total
    return out


def equal_wall_time(out, scores, arms, first):
    """Each arm's score at its last evaluated step within the seed's budget: the shortest total
    training time over the arms of that seed."""
    clocks = {}
    for arm in arms:
        for seed in {sd for step in scores[arm].values() for sd in step}:
            path = out / f"{arm}-{seed}" / "metrics.jsonl"
            if path.exists():
                clocks[(arm, seed)] = cumulative_seconds(path)
    seeds = sorted({seed for (_, seed) in clocks})
    at_budget = defaultdict(dict)
    budgets = {}
    for seed in seeds:
        finished = [clocks[(a, seed)] for a in arms if (a, seed) in clocks]
        if len(finished) < len(arms):
            continue
        budgets[seed] = min(max(c.values()) for c in finished)
        for arm in arms:
            clock = clocks[(arm, seed)]
            within = [st for st in scores[arm] if seed in scores[arm][st]
                      and clock.get(st, math.inf) <= budgets[seed] + 1e-9]
            if within:
                at_budget[arm][seed] = (max(within), scores[arm][max(within)][seed])
    if not budgets:
        return
    print("\nAt equal wall time (per seed: the shortest arm's training time; each arm scored at its "
          "last evaluation within it):\n")
    print("| arm | score | step reached (mean) | seeds |")
    print("|---|--:|--:|---|")
    for arm in arms:
        got = at_budget[arm]
        if got:
            xs = [v for (_, v) in got.values()]
            step = sum(st for (st, _) in got.values()) / len(got)
            print(f"| `{arm}` | {fmt(*mean_ci(xs))} | {step:.0f} | {', '.join(map(str, sorted(got)))} |")
    budget_list = ", ".join(f"{sd}: {b:.0f} s" for sd, b in sorted(budgets.items()))
    print(f"\nBudgets: {budget_list}.")
    if first in at_budget:
        print(f"\nPaired differences `{first}` − arm at equal wall time:\n")
        print("| arm | n | mean diff | 95 % t CI | 95 % bootstrap CI | beyond noise |")
        print("|---|--:|--:|---|---|---|")
        for arm in arms[1:]:
            common = sorted(set(at_budget[first]) & set(at_budget[arm]))
            diffs = [at_budget[first][sd][1] - at_budget[arm][sd][1] for sd in common]
            if len(diffs) < 2:
                continue
            m, h = mean_ci(diffs)
            lo, hi = bootstrap_ci(diffs)
            beyond = ("too few seeds" if len(diffs) < MIN_SEEDS
                      else "yes" if (m - h > 0 or m + h < 0) and (lo > 0 or hi < 0) else "no")
            print(f"| `{arm}` | {len(diffs)} | {m:+.3f} | [{m - h:+.3f}, {m + h:+.3f}] "
                  f"| [{lo:+.3f}, {hi:+.3f}] | {beyond} |")


def fmt(m, h):
    return f"{m:.3f} ± {h:.3f}" if not math.isnan(h) else f"{m:.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tag", help="the validation env tag (default: the only one evaluated)")
    ap.add_argument("--metric", default="success")
    ap.add_argument("--first", default="step_gae", help="the arm the others are compared with")
    ap.add_argument("--exclude-seeds", default="", help="comma-separated seeds to leave out")
    args = ap.parse_args()
    excluded = frozenset(int(s) for s in args.exclude_seeds.split(",") if s.strip())
    scores, episodes = collect(args.out, args.tag, args.metric, excluded)
    if not scores:
        sys.exit(f"{args.out}: no evaluation JSON yet")
    arms = [args.first] + sorted(a for a in scores if a != args.first) if args.first in scores \
        else sorted(scores)
    steps = sorted({s for a in arms for s in scores[a] if scores[a][s]})
    print(f"{args.tag or 'validation'} {args.metric}, greedy, {'/'.join(map(str, sorted(episodes)))} episodes per "
          f"evaluation; mean ± 95 % CI half-width over seeds (n = seeds finished)\n")
    print("| arm | " + " | ".join(f"step {s}" for s in steps) + " | seeds |")
    print("|---|" + "--:|" * len(steps) + "---|")
    for arm in arms:
        cells = []
        for s in steps:
            xs = list(scores[arm][s].values())
            cells.append(f"{fmt(*mean_ci(xs))} (n={len(xs)})" if xs else "–")
        last = max(s for s in steps if scores[arm][s])
        seeds = sorted(scores[arm][last])
        print(f"| `{arm}` | " + " | ".join(cells) + f" | {', '.join(map(str, seeds))} |")
    if args.first in scores:
        paired_differences(scores, arms, steps, args.first)
    equal_wall_time(args.out, scores, arms, args.first)
    critic_table(args.out, arms, excluded)


MIN_SEEDS = 5


def paired_differences(scores, arms, steps, first):
    print(f"\nPaired differences `{first}` − arm (same seed, same warm start, same episodes):\n")
    print("| arm | step | n | mean diff | 95 % t CI | 95 % bootstrap CI | beyond noise "
          "| detectable at 80 % power |")
    print("|---|--:|--:|--:|---|---|---|--:|")
    for arm in arms[1:]:
        for s in steps:
            if s == 0:
                continue
            common = sorted(set(scores[first][s]) & set(scores[arm][s]))
            if len(common) < 2:
                continue
            d = [scores[first][s][k] - scores[arm][s][k] for k in common]
            m, h = mean_ci(d)
            lo, hi = bootstrap_ci(d)
            beyond = (m - h > 0 or m + h < 0) and (lo > 0 or hi < 0)
            verdict = "too few seeds" if len(d) < MIN_SEEDS else ("yes" if beyond else "no")
            print(f"| `{arm}` | {s} | {len(d)} | {m:+.3f} | [{m - h:+.3f}, {m + h:+.3f}] | "
                  f"[{lo:+.3f}, {hi:+.3f}] | {verdict} | {detectable_difference(h, len(d)):.3f} |")


if __name__ == "__main__":
    main()
