#!/usr/bin/env python3
"""A tool-calling agent that stepppo trains: it answers multi-hop search questions by calling a
`search` function and an `answer` function, through any OpenAI-compatible endpoint, with the
official `openai` client and nothing of stepppo's.

The task and the functions are the environment's: `stepppo env serve hotpotqa --set tools=true`
serves the episodes (plain HTTP, stepppo's agent protocol: `POST /agent/reset` gives the system
prompt, the question and the function schemas; `POST /agent/step` takes the model's reply message
and gives back the tool results, or a user message after a reply that called nothing, and the
turn's reward). The agent runs the
usual tool loop: ask the model with `tools=...`, hand its reply to the env, append the tool
results, ask again, until the env says the episode is over.

Each episode is one gateway session (header `x-session-id`); the episodes of one question share a
task id (header `x-task-id`), so group-relative estimators compare them; the episode's per-turn
rewards close the session (`POST /v1/sessions/{id}/close`). Against `stepppo train` with a
`gateway` section (configs/hotpotqa_tools_gateway.yaml) the trainer updates after every batch of
closed groups; against `stepppo serve` it is just an agent. Prints the exact match (the env's
`success`) per `--report-every` episodes.

    stepppo env serve hotpotqa --set tools=true ... --port 8766 &
    python examples/openai_search_agent.py --base-url http://127.0.0.1:8000/v1 \\
        --env-url http://127.0.0.1:8766 --questions 2000
"""

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


class Episode:
    """One episode of the env server's environment."""

    def __init__(self, env_url, seed):
        self.env_url = env_url
        start = post(f"{env_url}/agent/reset", {"seed": seed})
        self.env_id = start["env_id"]
        self.tools = start["tools"]
        self.messages = [{"role": "system", "content": start["system"]},
                         {"role": "user", "content": start["user"]}]

    def step(self, reply):
        """Hands the model's reply to the env; appends what comes next; returns the step's body."""
        message = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in reply.tool_calls]
        self.messages.append(message)
        out = post(f"{self.env_url}/agent/step", {"env_id": self.env_id, "message": message})
        for result in out["tool_results"]:
            self.messages.append({"role": "tool", "tool_call_id": result["tool_call_id"],
                                  "content": result["content"]})
        if out["user"] is not None:
            self.messages.append({"role": "user", "content": out["user"]})
        return out

    def close(self):
        post(f"{self.env_url}/agent/close", {"env_id": self.env_id})


def play(client, args, seed, member):
    """One episode; returns whether it answered correctly."""
    episode = Episode(args.env_url, seed)
    session = f"q{seed}-{member}"
    headers = {"x-session-id": session, "x-task-id": f"q{seed}"}
    rewards, success = [], False
    try:
        while True:
            reply = client.chat.completions.create(
                model=args.model, messages=episode.messages, tools=episode.tools,
                max_tokens=args.max_tokens, temperature=args.temperature, extra_headers=headers)
            out = episode.step(reply.choices[0].message)
            rewards.append(out["reward"])
            success = out["info"]["success"]
            if out["done"]:
                break
    finally:
        episode.close()
    post(f"{args.base_url}/sessions/{session}/close", {"rewards": rewards, "success": success})
    return success


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the model's endpoint")
    p.add_argument("--env-url", default="http://127.0.0.1:8766", help="`stepppo env serve`")
    p.add_argument("--model", default="stepppo")
    p.add_argument("--questions", type=int, default=1000,
                   help="questions to play (each by --group episodes)")
    p.add_argument("--first-seed", type=int, default=0, help="env seed of the first question")
    p.add_argument("--group", type=int, default=4, help="episodes per question (the trainer's group_size)")
    p.add_argument("--parallel", type=int, default=16, help="episodes played at once")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="reply length in tokens (a call takes about 30 of the built-in model's)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--report-every", type=int, default=128, help="print the EM every N episodes")
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
                print(json.dumps({"episodes": done, "em": sum(window) / len(window)}), flush=True)
                window.clear()

    # Jobs are drawn as workers free up, so a run of many questions holds none of them in advance.
    jobs = ((args.first_seed + q, k) for q in range(args.questions) for k in range(args.group))

    def worker():
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            run(job)

    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            for worker_done in [pool.submit(worker) for _ in range(args.parallel)]:
                worker_done.result()
    except (openai.APIConnectionError, openai.APIStatusError, urllib.error.URLError) as e:
        print(f"the endpoint stopped answering ({e.__class__.__name__}); {done} episodes played",
              file=sys.stderr)

if __name__ == "__main__":
    main()
