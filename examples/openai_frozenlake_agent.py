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
it; it comes from the env bridge's FrozenLake adapter (`gym_env_server.FrozenLakeText`, beside this
file). Maps: gymnasium's `generate_random_map(4, p=0.8, seed=map)` with `is_slippery=False`.

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

import openai

from gym_env_server import BadRequest, FrozenLakeText

SYSTEM = "You're a helpful assistant. Always reply <answer>[your answer]</answer> with no extra text."
MAX_TURNS = 8
FORMAT_PENALTY = -0.1
ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)
# The env bridge's FrozenLake adapter: gymnasium's maps, stepppo's `grid_local` text, 0.1 shaping.
TEXT = FrozenLakeText("FrozenLake-v1", {}, random_maps=True, size=4, p=0.8, distance_reward=0.1)
INSTRUCTION = f"{TEXT.instruction}\nActions: {', '.join(TEXT.actions)}."


class Lake:
    """One episode of gymnasium's FrozenLake, written and shaped as the env bridge writes it."""

    def __init__(self, seed):
        self.env = TEXT.make(seed)
        self.obs, _ = self.env.reset(seed=seed)

    def render(self):
        return TEXT.render(self.env, self.obs)

    def step(self, name):
        """(reward, done, success) of the move `name`; None when it names no move."""
        try:
            action = TEXT.action(name)
        except BadRequest:
            return None
        before = self.obs
        self.obs, reward, terminated, truncated, gym_info = self.env.step(action)
        info, shaped = TEXT.info(self.env, before, self.obs, reward, terminated, gym_info)
        return shaped, terminated or truncated, info["success"]


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
            metadata={"env": args.env_tag} if args.env_tag else None,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": user_message(lake, turn)}])
        match = ANSWER.search(reply.choices[0].message.content + "</answer>")
        moved = lake.step(match.group(1)) if match else None
        if moved is None:
            rewards.append(FORMAT_PENALTY)
            continue
        reward, done, success = moved
        rewards.append(reward)
        if done:
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
    p.add_argument("--env-tag", default="SimpleFrozenLake",
                   help="metadata.env of the sessions: the trainer's env tag whose answer grammar the "
                        "gateway samples under when the run decodes constrained ('' for none)")
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
