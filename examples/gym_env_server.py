#!/usr/bin/env python3
"""Serve a gymnasium env over stepppo's env bridge protocol (docs/guides/env-bridge.md).

    python examples/gym_env_server.py FrozenLake-v1 --port 8765 --random-maps --distance-reward 0.1

Endpoints: GET /spec, POST /reset {seed}, POST /step {env_id, action}, POST /close {env_id}.
One server holds many episodes at once (one gymnasium env per episode, one thread per
connection). When it listens it prints one line, `serving ENV_ID at http://HOST:PORT` (with
--port 0 the system picks the port).

How an env is written as text is its adapter's business: FrozenLakeText writes the grid the way
stepppo's built-in `frozen_lake` does with `render: grid_local` (what each move leads to, where
the goal lies), which its small built-in model learns from; GenericText serves any env with a
Discrete action space (actions named "0".."n-1", observations from the "ansi" render or repr).
To give another env a readable text, subclass TextAdapter and add it to ADAPTERS.

Needs only the standard library and gymnasium (`bash scripts/examples_venv.sh`), and its
threaded HTTP server with a listen backlog for a batch of episodes from hub_env_common.py beside it.
"""

import argparse
import itertools
import json
import re
import sys
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler

import gymnasium as gym
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from hub_env_common import HubHTTPServer


class BadRequest(Exception):
    """A request the server refuses: answered with `status` and {"error": message}."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class TextAdapter:
    """How one gymnasium env is made and written as text.

    Subclasses set `instruction` and `actions` (names, or None for free-text actions) and write
    `make`, `action`, `render` and `info`.
    """

    instruction = ""
    actions = None

    def make(self, seed):
        """A fresh env for an episode reset with `seed`."""
        raise NotImplementedError

    def action(self, name):
        """The env action for the agent's text; raise BadRequest(400, ...) when it has none."""
        raise NotImplementedError

    def render(self, env, obs):
        """The observation text the agent reads."""
        raise NotImplementedError

    def info(self, env, before, obs, reward, terminated, gym_info):
        """`success`, `action_is_valid`, `action_is_effective` and numeric metrics of a step,
        and the reward the agent gets (an adapter may shape it)."""
        success = bool(gym_info.get("success", terminated and reward > 0))
        return {"success": success}, reward


class GenericText(TextAdapter):
    """Any env with a Discrete action space: actions "0".."n-1"; the observation's repr, after
    the env's "ansi" render when it has one (colour codes removed: what they marked is lost, a
    reason to write an adapter)."""

    COLOURS = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, env_id, make_kwargs):
        self.env_id = env_id
        self.kwargs = dict(make_kwargs)
        probe = gym.make(env_id, **self.kwargs)
        if "ansi" in probe.metadata.get("render_modes", []):
            self.kwargs.setdefault("render_mode", "ansi")
        space = probe.action_space
        probe.close()
        if not isinstance(space, gym.spaces.Discrete):
            sys.exit(f"{env_id}: action space {space} is not Discrete; add a TextAdapter for it")
        self.first = int(space.start)
        self.actions = [str(self.first + i) for i in range(int(space.n))]
        self.instruction = f"{env_id}: reply with one of the actions below."

    def make(self, seed):
        return gym.make(self.env_id, **self.kwargs)

    def action(self, name):
        if name not in self.actions:
            raise BadRequest(400, f"unknown action {name!r} (actions: {', '.join(self.actions)})")
        return int(name)

    def render(self, env, obs):
        text = f"Observation: {obs!r}"
        if self.kwargs.get("render_mode") == "ansi":
            text = self.COLOURS.sub("", str(env.render())).rstrip("\n") + "\n" + text
        return text


class FrozenLakeText(TextAdapter):
    """FrozenLake as stepppo's `frozen_lake` writes it with `render: grid_local`: the grid (P
    player, _ ice, O hole, G goal, X player in a hole, √ player on the goal), then what each move
    leads to (`Left: ice`, `Down: hole`, `Right: wall`, `Up: goal`) and the moves toward the goal
    with their distance (`Goal:`, `Down 2`, `Right 1`). Each action word starts a line, so it is
    the very token the answer writes.

    With `random_maps`, every reset seed draws its own map (gymnasium's generate_random_map: start
    top left, goal bottom right, a path guaranteed); else the map is gymnasium's (`map_name`,
    `desc`). `distance_reward` c adds c x (distance to the goal before - after) to each move's
    reward, as the built-in env's `distance_reward` (Manhattan distance)."""

    actions = ["Left", "Down", "Right", "Up"]
    MOVES = [(0, -1), (1, 0), (0, 1), (-1, 0)]
    CELLS = {b"S": "_", b"F": "_", b"H": "O", b"G": "G"}

    def __init__(self, env_id, make_kwargs, random_maps, size, p, distance_reward):
        self.env_id = env_id
        self.kwargs = {"is_slippery": False, **make_kwargs}
        self.random_maps = (size, p) if random_maps else None
        self.distance_reward = distance_reward
        slip = " The ice is slippery: a move may go sideways." if self.kwargs["is_slippery"] else ""
        self.instruction = (
            f"FrozenLake: walk from P to the goal G without stepping into a hole O.{slip}\n"
            "Symbols: P player, _ ice, O hole, G goal, X player in a hole, √ player on the goal."
        )

    def make(self, seed):
        kwargs = dict(self.kwargs)
        if self.random_maps:
            size, p = self.random_maps
            kwargs["desc"] = generate_random_map(size=size, p=p, seed=seed)
        return gym.make(self.env_id, **kwargs)

    def action(self, name):
        for index, action in enumerate(self.actions):
            if action.lower() == name.strip().lower():
                return index
        raise BadRequest(400, f"unknown action {name!r} (actions: {', '.join(self.actions)})")

    def render(self, env, obs):
        desc = env.unwrapped.desc
        rows, cols = desc.shape
        player = divmod(int(obs), cols)
        grid = []
        for r in range(rows):
            line = ""
            for c in range(cols):
                cell = desc[r][c]
                if (r, c) == player:
                    line += {b"H": "X", b"G": "√"}.get(cell, "P")
                else:
                    line += self.CELLS[cell]
            grid.append(line)
        return "\n".join(grid + self.local_lines(desc, player))

    def local_lines(self, desc, player):
        rows, cols = desc.shape
        lines = []
        for name, (dr, dc) in zip(self.actions, self.MOVES):
            r, c = player[0] + dr, player[1] + dc
            if not (0 <= r < rows and 0 <= c < cols):
                what = "wall"
            else:
                what = {b"H": "hole", b"G": "goal"}.get(desc[r][c], "ice")
            lines.append(f"{name}: {what}")
        goal = self.goal(desc)
        down, right = goal[0] - player[0], goal[1] - player[1]
        lines.append("Goal:")
        if down:
            lines.append(f"{'Down' if down > 0 else 'Up'} {abs(down)}")
        if right:
            lines.append(f"{'Right' if right > 0 else 'Left'} {abs(right)}")
        return lines

    @staticmethod
    def goal(desc):
        rows, cols = desc.shape
        return next((r, c) for r in range(rows) for c in range(cols) if desc[r][c] == b"G")

    def info(self, env, before, obs, reward, terminated, gym_info):
        desc = env.unwrapped.desc
        cols = desc.shape[1]
        goal = self.goal(desc)
        at, was = divmod(int(obs), cols), divmod(int(before), cols)
        distance = lambda cell: abs(goal[0] - cell[0]) + abs(goal[1] - cell[1])
        shaped = reward + self.distance_reward * (distance(was) - distance(at))
        info = {
            "success": bool(desc[at[0]][at[1]] == b"G"),
            "action_is_valid": True,
            "action_is_effective": at != was,
        }
        return info, shaped


class Episodes:
    """The live episodes by id, the oldest evicted beyond `limit` (a client that dies without
    closing leaks nothing for long)."""

    def __init__(self, adapter, limit):
        self.adapter = adapter
        self.limit = limit
        self.live = OrderedDict()
        self.ids = itertools.count(1)
        self.lock = threading.Lock()

    def reset(self, seed):
        env = self.adapter.make(seed)
        obs, _ = env.reset(seed=seed)
        with self.lock:
            env_id = str(next(self.ids))
            self.live[env_id] = [env, obs]
            while len(self.live) > self.limit:
                _, (old, _) = self.live.popitem(last=False)
                old.close()
        return env_id, self.adapter.render(env, obs)

    def step(self, env_id, name):
        episode = self.get(env_id)
        env, before = episode
        obs, reward, terminated, truncated, gym_info = env.step(self.adapter.action(name))
        episode[1] = obs
        info, reward = self.adapter.info(env, before, obs, float(reward), terminated, gym_info)
        return {
            "observation": self.adapter.render(env, obs),
            "reward": reward,
            "terminated": bool(terminated),
            "truncated": bool(truncated),
            "info": info,
        }

    def close(self, env_id):
        with self.lock:
            episode = self.live.pop(env_id, None)
        if episode is None:
            raise BadRequest(404, f"unknown env_id {env_id!r} (closed or evicted)")
        episode[0].close()

    def get(self, env_id):
        with self.lock:
            episode = self.live.get(env_id)
        if episode is None:
            raise BadRequest(404, f"unknown env_id {env_id!r} (closed or evicted)")
        return episode


def field(body, name, kind):
    """`body[name]`, checked to be a `kind`; BadRequest(400) names the field otherwise."""
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(400, f"`{name}` must be a {kind.__name__}, got {value!r}")
    return value


def handler(spec, episodes, verbose):
    """The request handler class of a server for `spec` and `episodes`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one connection per client env
        disable_nagle_algorithm = True  # headers and body leave at once, not after a delayed ACK

        def do_GET(self):
            self.answer(lambda: self.route_get())

        def do_POST(self):
            self.answer(lambda: self.route_post(self.read_json()))

        def route_get(self):
            if self.path != "/spec":
                raise BadRequest(404, f"no GET {self.path} (GET /spec)")
            return spec

        def route_post(self, body):
            if self.path == "/reset":
                seed = field(body, "seed", int)
                if seed < 0:
                    raise BadRequest(400, f"`seed` must be >= 0, got {seed}")
                env_id, observation = episodes.reset(seed)
                return {"env_id": env_id, "observation": observation, "info": {}}
            if self.path == "/step":
                return episodes.step(field(body, "env_id", str), field(body, "action", str))
            if self.path == "/close":
                episodes.close(field(body, "env_id", str))
                return {}
            raise BadRequest(404, f"no POST {self.path} (POST /reset, /step, /close)")

        def read_json(self):
            length = int(self.headers.get("Content-Length") or 0)
            try:
                return json.loads(self.rfile.read(length) or b"null")
            except ValueError as e:
                raise BadRequest(400, f"the body is not JSON: {e}")

        def answer(self, route):
            try:
                status, body = 200, route()
            except BadRequest as e:
                status, body = e.status, {"error": str(e)}
            except Exception as e:  # the env itself failed: tell the client, keep serving
                status, body = 500, {"error": f"{type(e).__name__}: {e}"}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):
            if verbose:
                super().log_message(format, *args)

    return Handler


def adapter_for(args):
    make_kwargs = json.loads(args.make)
    if args.env_id.startswith("FrozenLake"):
        return FrozenLakeText(
            args.env_id, make_kwargs, args.random_maps, args.size, args.p, args.distance_reward
        )
    return GenericText(args.env_id, make_kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env_id", nargs="?", default="FrozenLake-v1", help="a gymnasium env id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--make", default="{}", help="gym.make keyword arguments, as JSON")
    parser.add_argument("--random-maps", action="store_true", help="FrozenLake: a map per seed")
    parser.add_argument("--size", type=int, default=4, help="FrozenLake random map side")
    parser.add_argument("--p", type=float, default=0.8, help="FrozenLake: P(a cell is frozen)")
    parser.add_argument("--distance-reward", type=float, default=0.0, help="FrozenLake shaping")
    parser.add_argument("--max-episodes", type=int, default=4096, help="live episodes kept")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args()

    adapter = adapter_for(args)
    probe = adapter.make(0)
    spec = {
        "name": args.env_id,
        "instruction": adapter.instruction,
        "actions": adapter.actions,
        "max_steps": probe.spec.max_episode_steps if probe.spec else None,
    }
    probe.close()
    episodes = Episodes(adapter, args.max_episodes)
    server = HubHTTPServer((args.host, args.port), handler(spec, episodes, args.verbose))
    host, port = server.server_address[:2]
    print(f"serving {args.env_id} at http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
