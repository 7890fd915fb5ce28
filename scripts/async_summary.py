"""Summarises the runs of scripts/async_bench.sh: OUT/k{arm}-s{seed}/metrics.jsonl, arms 0, 1, 2
and, where they were run, 1b and 2b (`proximal: behaviour`).

Per staleness k and seed: mean seconds per step (after step 1), the rollout's and the update's
seconds, the trainer's wait for a batch, the busy shares of both sides, the speed-up over the
synchronous run of the same seed next to its ideal (the synchronous run's mean of rollout + update
over its mean of max(rollout, update)), and validation success at every evaluation.

    python3 scripts/async_summary.py OUT SEED...
"""
import json
import sys


def rows(run):
    with open(f"{run}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def summary(run):
    metrics = rows(run)
    # Step 1 warms caches and allocators up (and an async run's first batch is not overlapped).
    steps = [r for r in metrics if "time/step" in r][1:]
    if not steps:
        raise FileNotFoundError(f"{run}: no step finished yet")
    mean = lambda key: sum(r.get(key, 0.0) for r in steps) / len(steps)
    val = {}
    for r in metrics:
        for key, value in r.items():
            if key.startswith("val/") and key.endswith("/success"):
                val[r["step"]] = value
    return {
        "step": mean("time/step"),
        "rollout": mean("time/rollout"),
        "update": mean("time/update"),
        "proximal": mean("time/proximal"),
        "wait": mean("time/trainer_wait"),
        "rollout_busy": steps[-1].get("async/rollout_busy"),
        "trainer_busy": steps[-1].get("async/trainer_busy"),
        "ideal": (sum(r["time/rollout"] + r["time/update"] for r in steps)
                  / sum(max(r["time/rollout"], r["time/update"]) for r in steps)),
        "val": val,
    }


def main():
    out, seeds = sys.argv[1], sys.argv[2:]
    print("| k | seed | s/step | rollout s | update s | proximal s | trainer wait s "
          "| busy rollout / trainer | speed-up (ideal) | validation success by step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        base = summary(f"{out}/k0-s{seed}")
        for k in ("0", "1", "1b", "2", "2b"):
            try:
                s = summary(f"{out}/k{k}-s{seed}")
            except FileNotFoundError:
                continue
            busy = ("—" if s["rollout_busy"] is None
                    else f"{s['rollout_busy']:.2f} / {s['trainer_busy']:.2f}")
            speed = base["step"] / s["step"]
            val = " ".join(f"{step}:{v:.3f}" for step, v in sorted(s["val"].items()))
            print(f"| {k} | {seed} | {s['step']:.2f} | {s['rollout']:.2f} | {s['update']:.2f} "
                  f"| {s['proximal']:.2f} | {s['wait']:.2f} | {busy} "
                  f"| {speed:.2f}× ({base['ideal']:.2f}×) | {val} |")


if __name__ == "__main__":
    main()
