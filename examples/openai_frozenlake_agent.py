#!/usr/bin/env python3
"""An outside agent that stepppo trains: it plays gymnasium's FrozenLake through any
OpenAI-compatible endpoint with the official `openai` client and nothing of stepppo's.

Each episode is one gateway session (header `x-session-id`); the episodes of one map share a task
id (header `x-task-id`), so group-relative estimators compare them; the episode's per-step rewards
close the session (`POST /v1/sessions/{id}/close`, plain HTTP). Against `stepppo train` with a
`gateway` section (configs/frozenlake_gateway.yaml) the trainer updates after every batch of closed
groups and the agent's success rises; against `stepppo serve --record DIR` the episodes are
recorded into a step dataset.

The text is the one stepppo's own FrozenLake speaks (render `grid_local`, one action per turn,
each turn a fresh prompt with the current state), so a policy warm-started on stepppo's env reads
it. Maps: gymnasium's `generate_random_map(4, p=0.8, seed=map)` with `is_slippery=False`.

    python examples/openai_frozenlake_agent.py --base-url http://127.0.0.1:8000/v1 --maps 400
"""

import argparse
import json
import re
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import gymnasium as gym
import openai
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

ACTIONS = ["Left", "Down", "Right", "Up"]  # gymnasium's action ids 0..3
OFFSETS = [(0, -1), (1, 0), (0, 1), (-1, 0)]
SYSTEM = "You're a helpful assistant. Always reply <answer>[your answer]</answer> with no extra text."
INSTRUCTION = (
    "FrozenLake: walk from P to the goal G without stepping into a hole O.\n"
    "Symbols: P player, _ ice, O hole, G goal, X player in a hole, √ player on the goal.\n"
    "Actions: Left, Down, Right, Up."
)
MAX_TURNS = 8
FORMAT_PENALTY = -0.1
DISTANCE_REWARD = 0.1
ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)


class Lake:
    """gymnasium's FrozenLake with stepppo's text render and reward shaping."""

    def __init__(self, seed):
        self.desc = generate_random_map(size=4, p=0.8, seed=seed)
        self.env = gym.make("FrozenLake-v1", desc=self.desc, is_slippery=False)
        self.pos, _ = self.env.reset(seed=seed)
        self.size = len(self.desc)

    def cell(self, pos):
        return self.desc[pos // self.size][pos % self.size]

    def goal(self):
        return next(i for i in range(self.size**2) if self.cell(i) == "G")

    def distance(self, pos):
        g = self.goal()
        return abs(g // self.size - pos // self.size) + abs(g % self.size - pos % self.size)

    def neighbour(self, pos, action):
        r, c = pos // self.size + OFFSETS[action][0], pos % self.size + OFFSETS[action][1]
        return r * self.size + c if 0 <= r < self.size and 0 <= c < self.size else pos

    def render(self):
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                cell, here = self.desc[r][c], r * self.size + c == self.pos
                row += {"H": "X", "G": "√"}.get(cell, "P") if here else {"H": "O", "G": "G"}.get(cell, "_")
            rows.append(row)
        lines = []
        for a, name in enumerate(ACTIONS):
            nxt = self.neighbour(self.pos, a)
            what = "wall" if nxt == self.pos else {"H": "hole", "G": "goal"}.get(self.cell(nxt), "ice")
            lines.append(f"{name}: {what}")
        g = self.goal()
        dr, dc = g // self.size - self.pos // self.size, g % self.size - self.pos % self.size
        lines.append("Goal:")
        for dist, name in ((dr, "Up" if dr < 0 else "Down"), (dc, "Left" if dc < 0 else "Right")):
            if dist:
                lines.append(f"{name} {abs(dist)}")
        return "\n".join(rows + lines)

    def step(self, action):
        before = self.distance(self.pos)
        self.pos, reward, terminated, truncated, _ = self.env.step(action)
        return reward + DISTANCE_REWARD * (before - self.distance(self.pos)), terminated


def user_message(lake, turn):
    block = f"Turn {turn}:\nState:\n{lake.render()}\nYou have {MAX_TURNS + 1 - turn} actions left.\n"
    return f"{INSTRUCTION}\n{block}"


def close_session(base_url, session, rewards, success):
    body = json.dumps({"rewards": rewards, "success": success}).encode()
    req = urllib.request.Request(f"{base_url}/sessions/{session}/close", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


def play(client, args, map_seed, member):
    """One episode; returns its success."""
    lake = Lake(map_seed)
    session = f"map{map_seed}-{member}"
    headers = {"x-session-id": session, "x-task-id": f"map{map_seed}"}
    rewards, success = [], False
    for turn in range(1, MAX_TURNS + 1):
        reply = client.chat.completions.create(
            model=args.model, max_tokens=8, temperature=1.0, extra_headers=headers,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": user_message(lake, turn)}])
        match = ANSWER.search(reply.choices[0].message.content + "</answer>")
        name = match.group(1).strip().capitalize() if match else None
        if name not in ACTIONS:
            rewards.append(FORMAT_PENALTY)
            continue
        reward, done = lake.step(ACTIONS.index(name))
        rewards.append(reward)
        if done:
            success = lake.cell(lake.pos) == "G"
            break
    close_session(args.base_url, session, rewards, success)
    return success


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="stepppo")
    p.add_argument("--maps", type=int, default=400, help="maps to play (each by --group episodes)")
    p.add_argument("--group", type=int, default=4, help="episodes per map (the trainer's group_size)")
    p.add_argument("--parallel", type=int, default=16, help="episodes played at once")
    p.add_argument("--report-every", type=int, default=64, help="print success every N episodes")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=600)
    lock, window, done = threading.Lock(), [], 0

    def run(job):
        nonlocal done
        ok = play(client, args, *job)
        with lock:
            window.append(ok)
            done += 1
            if len(window) == args.report_every:
                print(json.dumps({"episodes": done, "success": sum(window) / len(window)}), flush=True)
                window.clear()

    jobs = [(m, k) for m in range(args.maps) for k in range(args.group)]
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(run, jobs))
    except (openai.APIConnectionError, openai.APIStatusError, urllib.error.URLError) as e:
        print(f"the endpoint stopped answering ({e.__class__.__name__}); {done} episodes played",
              file=sys.stderr)


if __name__ == "__main__":
    main()
