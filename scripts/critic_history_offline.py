#!/usr/bin/env python3
"""Replays a FrozenLake run's batches to a state critic offline: how well would it have predicted
each next batch's step returns, for a given input and fitting history?

Reads `stepppo replay RUN/dataset --format jsonl` saved to a file, computes each batch's
Monte-Carlo step returns (gamma), and for every setting refits one value MLP (256 wide, SiLU,
AdamW at 1e-3, as `critic.mode: state`) after each batch, on the rows of the last K batches
(`critic.history_batches`), in as many mini-batches of 8 as `epochs` passes over the newest
batch take, inputs centred and scaled by one factor as the trainer does; with `--decay d < 1` a
row of a batch k batches old is drawn with weight d**k instead of uniformly. It then scores the
rollout-time prediction of the next batch, as `critic/vf_explained_var` does, and prints over
the last 20 batches the mean and median of the per-batch explained variance and the pooled one
(1 - sum of squared residuals / sum of squared deviations), with the tabular ceiling beside
them. Inputs: `facts`, the first 8 numbers of each record's critic state (the whole map's planning
facts); `moves`, those plus each move's facts (wall, hole, goal, nearer over ice, nearer by
Manhattan distance, the landing cell's adjacent holes and ways on), computed here from the
record's grid so that runs stored before the env gave them can be replayed. Needs numpy and torch,
and `critic_predictability.py` beside it (the returns and the tabular ceiling).

    stepppo replay RUN/dataset --format jsonl > run.jsonl
    python3 scripts/critic_history_offline.py run.jsonl --inputs facts,moves --history 1,8,32
"""
import argparse
import collections

import numpy as np
import torch

from critic_predictability import explained_variance, step_returns, tabular_ceiling

# Left, Down, Right, Up as (row, column) offsets: the env's ACTIONS order.
OFFSETS = [(0, -1), (1, 0), (0, 1), (-1, 0)]


def grid_of(observation):
    lines = []
    for line in observation.split("\n"):
        if ":" in line:
            break
        lines.append(line)
    return lines


def moves_to_goal(grid, goal):
    """Fewest moves over ice from each cell to the goal (BFS); absent for holes and cut-off cells."""
    n = len(grid)
    moves = {goal: 0}
    queue = collections.deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in OFFSETS:
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in moves and grid[nr][nc] != "O":
                moves[(nr, nc)] = moves[(r, c)] + 1
                queue.append((nr, nc))
    return moves


def move_facts(observation):
    """The env's per-move critic facts (`FrozenLakeEnv::move_facts`), Left, Down, Right, Up."""
    grid = grid_of(observation)
    n = len(grid)
    player = goal = None
    for r, row in enumerate(grid):
        for c, ch in enumerate(row):
            if ch in "PX√":
                player = (r, c)
            if ch in "G√":
                goal = (r, c)
    goal = goal or player
    moves = moves_to_goal(grid, goal)

    def step(cell, dr, dc):
        r, c = cell[0] + dr, cell[1] + dc
        return (r, c) if 0 <= r < n and 0 <= c < n else cell

    def nearer(a, b):
        return a in moves and b in moves and moves[b] < moves[a]

    def manhattan(cell):
        return abs(cell[0] - goal[0]) + abs(cell[1] - goal[1])

    facts = []
    for dr, dc in OFFSETS:
        nxt = step(player, dr, dc)
        wall = nxt == player
        ch = grid[nxt[0]][nxt[1]]
        on_ice = not wall and ch == "_"
        around = [step(nxt, a, b) for a, b in OFFSETS]
        around = [x for x in around if x != nxt]
        holes = sum(grid[x[0]][x[1]] == "O" for x in around) / 4 if on_ice else 0.0
        ways = sum(nearer(nxt, x) for x in around) / 4 if on_ice else 0.0
        facts += [
            float(wall),
            float(not wall and ch == "O"),
            float(not wall and ch == "G"),
            float(not wall and nearer(player, nxt)),
            float(manhattan(nxt) < manhattan(player)),
            holes,
            ways,
        ]
    return facts


def load_batches(path, gamma):
    with open(path) as f:
        by_version = step_returns(f, gamma)
    batches = []
    for version in sorted(by_version):
        rows = by_version[version]
        facts = [r["critic_state"][:8] for r, _ in rows]
        moves = [move_facts(r["info"]["observation_text"]) for r, _ in rows]
        batches.append(
            {
                "facts": np.array(facts, np.float32),
                "moves": np.concatenate([facts, moves], 1).astype(np.float32),
                "returns": np.array([g for _, g in rows], np.float32),
                "ceiling_rows": [(None, g, (r["group_id"], r["state_hash"])) for r, g in rows],
            }
        )
    return batches


def replay(batches, inputs, history, epochs, last, decay=1.0, seed=0, mini_batch=8, width=256):
    torch.manual_seed(seed)
    dim = batches[0][inputs].shape[1]
    net = torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.SiLU(), torch.nn.Linear(width, 1))
    for p in net.parameters():
        torch.nn.init.normal_(p, 0, 0.02) if p.dim() > 1 else torch.nn.init.zeros_(p)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
    per_batch, residual, total = [], 0.0, 0.0
    for t in range(len(batches) - 1):
        kept = batches[max(0, t - history + 1) : t + 1]
        x = torch.tensor(np.concatenate([b[inputs] for b in kept]))
        y = torch.tensor(np.concatenate([b["returns"] for b in kept]))
        age = np.concatenate([np.full(len(b["returns"]), len(kept) - 1 - i) for i, b in enumerate(kept)])
        weight = torch.tensor(decay**age, dtype=torch.float64)
        mean = x.mean(0)
        scale = 1 / (x - mean).pow(2).mean().sqrt().clamp(min=1e-6)
        updates = epochs * -(-len(batches[t]["returns"]) // mini_batch)
        gen = torch.Generator().manual_seed(t)
        for _ in range(updates):
            if decay == 1.0:
                pick = torch.randint(0, len(y), (mini_batch,), generator=gen)
            else:
                pick = torch.multinomial(weight, mini_batch, replacement=True, generator=gen)
            loss = 0.5 * (net((x[pick] - mean) * scale).squeeze(1) - y[pick]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        nxt = batches[t + 1]
        if t + 1 >= len(batches) - last:
            with torch.no_grad():
                pred = net((torch.tensor(nxt[inputs]) - mean) * scale).squeeze(1).numpy()
            g = nxt["returns"]
            per_batch.append(explained_variance(pred, g))
            residual += float(np.sum((g - pred - np.mean(g - pred)) ** 2))
            total += float(np.sum((g - g.mean()) ** 2))
    return float(np.nanmean(per_batch)), float(np.nanmedian(per_batch)), 1.0 - residual / total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset_jsonl")
    ap.add_argument("--gamma", type=float, default=0.95)
    ap.add_argument("--inputs", default="facts,moves")
    ap.add_argument("--history", default="1,8,32")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--last", type=int, default=20)
    ap.add_argument("--decay", default="1.0", help="rows drawn with weight decay**age (batches)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = load_batches(args.dataset_jsonl, args.gamma)
    ceiling = np.mean([tabular_ceiling(b["ceiling_rows"]) for b in batches[-args.last :]])
    print(f"{len(batches)} batches; tabular ceiling, mean of the last {args.last}: {ceiling:.3f}")
    for inputs in args.inputs.split(","):
        for k in (int(h) for h in args.history.split(",")):
            for decay in (float(d) for d in args.decay.split(",")):
                mean, median, pooled = replay(batches, inputs, k, args.epochs, args.last, decay)
                print(
                    f"inputs {inputs:5s} history {k:3d} decay {decay:.2f}: "
                    f"EV mean {mean:.3f}, median {median:.3f}, pooled {pooled:.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
