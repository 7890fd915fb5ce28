"""What the hub env servers share (examples/gem_env_server.py, textarena_env_server.py,
textworld_env_server.py; gym_env_server.py takes its HTTP server class): the HTTP side of stepppo's env bridge protocol, the live episodes with
their eviction, seed checks and the per-episode state of the process-wide RNGs.

The protocol is docs/guides/env-bridge.md; docs/guides/env-hubs.md describes the optional fields
these servers add (`seed_max`, `env_max_steps` in /spec; `instruction`, `oracle_action`,
`admissible_actions` in /reset and /step answers), which a client that does not know them ignores.

A server is a `Backend` (its /spec, reset, step) handed to `serve`. Each episode is an `Episode`
kept in `Episodes` under a string id; requests for one episode are serialised by its own lock,
requests for different episodes run concurrently (one thread per connection, as in
examples/gym_env_server.py). Only the standard library (and numpy where a hub needs its RNG).
"""

import argparse
import itertools
import json
import random
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:  # numpy's global RNG is part of an episode's state where numpy is installed
    import numpy as np
except ImportError:  # pragma: no cover - every hub here brings numpy
    np = None

SEED_LIMIT = 2**64 - 1  # the protocol's seeds are unsigned 64-bit integers

# Moves of the games whose moves are a small fixed set: /spec lists them and the agent answers one.
HANOI_MOVES = ["A B", "A C", "B A", "B C", "C A", "C B"]
DIRECTIONS = ["up", "down", "left", "right"]


class BadRequest(Exception):
    """A request the server refuses: answered with `status` and {"error": message}."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def field(body, name, kind):
    """`body[name]`, checked to be a `kind`; BadRequest(400) names the field otherwise."""
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(400, f"`{name}` must be a {kind.__name__}, got {value!r}")
    return value


def check_seed(seed, seed_max, wrap, why):
    """The seed an episode is made from: `seed` itself when 0 <= seed <= seed_max; with `wrap`,
    seed mod (seed_max + 1); else BadRequest(400) naming the seed, the range and `why`."""
    if not 0 <= seed <= SEED_LIMIT:
        raise BadRequest(400, f"`seed` must be in 0..{SEED_LIMIT}, got {seed}")
    if seed <= seed_max:
        return seed
    if wrap:
        return seed % (seed_max + 1)
    raise BadRequest(
        400,
        f"seed {seed} is out of range: this server takes seeds 0..{seed_max} ({why}); "
        f"send seeds <= /spec's seed_max, or start the server with --seed-wrap to use "
        f"seed mod {seed_max + 1}",
    )


class GlobalRng:
    """The state of the process-wide RNGs (`random`, and numpy's legacy global RNG when numpy is
    importable) that belongs to one episode.

    Hub envs draw hidden state from these globals during play (GEM's Minesweeper places its
    mines at the first reveal, 2048 drops tiles, TextArena seeds `random` at reset), so episodes
    stepped alternately in one process would consume each other's draws. `active()` runs one call
    into the episode's env with the episode's own RNG state installed, under one process-wide
    lock, and keeps the state the call left: each episode then sees the same draws as if it ran
    alone, whatever else runs concurrently."""

    lock = threading.Lock()

    def __init__(self, seed):
        # Every episode starts from a state derived from its seed alone (env constructors that
        # draw before their own seeding are deterministic too); the env's reset seeds it again.
        self.py = random.Random(seed).getstate()
        self.np = None
        if np is not None:
            self.np = np.random.RandomState([seed & 0xFFFFFFFF, seed >> 32]).get_state()

    @contextmanager
    def active(self):
        with GlobalRng.lock:
            random.setstate(self.py)
            if np is not None:
                np.random.set_state(self.np)
            try:
                yield
            finally:
                self.py = random.getstate()
                if np is not None:
                    self.np = np.random.get_state()


class Episode:
    """One live episode: the backend's env object and what the server tracks about it."""

    def __init__(self, env, seed):
        self.env = env
        self.seed = seed
        self.steps = 0
        self.done = False
        self.lock = threading.Lock()  # one request at a time per episode
        self.last_used = time.monotonic()
        self.extra = {}  # backend-specific state (oracle caches, last observation, ...)

    def close(self):
        close = getattr(self.env, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # an env that fails to close must not break the server
                pass


class Episodes:
    """The live episodes by id, least recently used first. Beyond `limit` episodes, or once one
    has been idle `idle_timeout` seconds (0: never), the least recently used are evicted and
    closed: a client that dies without closing leaks nothing for long."""

    def __init__(self, limit, idle_timeout):
        self.limit = limit
        self.idle_timeout = idle_timeout
        self.live = OrderedDict()
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.evicted = 0

    def add(self, episode):
        evicted = []
        with self.lock:
            env_id = str(next(self.ids))
            self.live[env_id] = episode
            now = time.monotonic()
            while self.live:
                oldest_id, oldest = next(iter(self.live.items()))
                idle = self.idle_timeout and now - oldest.last_used > self.idle_timeout
                if len(self.live) <= self.limit and not idle:
                    break
                self.live.popitem(last=False)
                evicted.append(oldest)
            self.evicted += len(evicted)
        for old in evicted:
            with old.lock:
                old.close()
        return env_id

    def get(self, env_id):
        with self.lock:
            episode = self.live.get(env_id)
            if episode is None:
                raise BadRequest(404, f"unknown env_id {env_id!r} (closed or evicted)")
            self.live.move_to_end(env_id)
            episode.last_used = time.monotonic()
        return episode

    def close(self, env_id):
        with self.lock:
            episode = self.live.pop(env_id, None)
        if episode is None:
            raise BadRequest(404, f"unknown env_id {env_id!r} (closed or evicted)")
        with episode.lock:
            episode.close()

    def __len__(self):
        with self.lock:
            return len(self.live)


class Backend:
    """A hub's side of the server. `spec` is the /spec answer (with `seed_max`) and `seed_why`
    says in words where seed_max comes from; `new_episode(seed)` makes an Episode and returns
    (episode, the /reset answer without env_id); `step(episode, action)` returns the /step answer
    and runs with the episode's lock held."""

    seed_why = ""

    spec = {}

    # The moves /spec lists (None: free text), and whether answers carry `oracle_action`.
    actions = None
    oracle = False

    def new_episode(self, seed):
        raise NotImplementedError

    def step(self, episode, action):
        raise NotImplementedError

    def oracle_action(self, episode):
        """The oracle's next action from `episode`'s state, or None where it has none."""
        return None

    def listed_action(self, action):
        """`action` spelled as /spec lists it (matched case-insensitively); None for a free-text
        game; BadRequest(400) for a name outside the list."""
        if self.actions is None:
            return None
        for name in self.actions:
            if name.lower() == action.strip().lower():
                return name
        raise BadRequest(400, f"unknown action {action!r} (actions: {', '.join(self.actions)})")

    def add_oracle(self, episode, answer):
        """Adds the oracle's next action to `answer`, where the server sends one."""
        if self.oracle:
            action = self.oracle_action(episode)
            if action is not None:
                answer["oracle_action"] = action

    def first_answer(self, episode, instruction, observation, rules_in_observation):
        """The /reset answer (without env_id) of a new episode."""
        answer = {
            "observation": with_rules(instruction, observation, rules_in_observation),
            "info": {},
            "instruction": instruction,
        }
        self.add_oracle(episode, answer)
        return answer


class Server:
    """Routes the protocol's requests to a Backend and the live Episodes."""

    def __init__(self, backend, episodes, seed_wrap):
        self.backend = backend
        self.episodes = episodes
        self.seed_wrap = seed_wrap

    def reset(self, body):
        seed = field(body, "seed", int)
        spec = self.backend.spec
        seed = check_seed(seed, spec["seed_max"], self.seed_wrap, self.backend.seed_why)
        episode, answer = self.backend.new_episode(seed)
        env_id = self.episodes.add(episode)
        return {"env_id": env_id, **answer}

    def step(self, body):
        env_id = field(body, "env_id", str)
        action = field(body, "action", str)
        episode = self.episodes.get(env_id)
        with episode.lock:
            if episode.done:
                raise BadRequest(
                    400, f"episode {env_id!r} is over after {episode.steps} steps; reset a new one"
                )
            answer = self.backend.step(episode, action)
            episode.steps += 1
            episode.done = answer["terminated"] or answer["truncated"]
            if episode.done:
                answer.pop("oracle_action", None)
                answer.pop("admissible_actions", None)
        return answer

    def close(self, body):
        self.episodes.close(field(body, "env_id", str))
        return {}


def handler(server, verbose):
    """The request handler class of an HTTP server for `server`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one connection per client env
        disable_nagle_algorithm = True  # headers and body leave at once, not after a delayed ACK

        def do_GET(self):
            self.answer(self.route_get)

        def do_POST(self):
            self.answer(lambda: self.route_post(self.read_json()))

        def route_get(self):
            if self.path != "/spec":
                raise BadRequest(404, f"no GET {self.path} (GET /spec)")
            return server.backend.spec

        def route_post(self, body):
            routes = {"/reset": server.reset, "/step": server.step, "/close": server.close}
            route = routes.get(self.path)
            if route is None:
                raise BadRequest(404, f"no POST {self.path} (POST /reset, /step, /close)")
            return route(body)

        def read_json(self):
            length = int(self.headers.get("Content-Length") or 0)
            try:
                return json.loads(self.rfile.read(length) or b"null")
            except ValueError as e:
                raise BadRequest(400, f"the body is not JSON: {e}") from None

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


def add_server_args(parser, max_episodes=4096):
    """The flags every hub server takes."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument(
        "--max-episodes", type=int, default=max_episodes, help="live episodes kept (LRU eviction)"
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=3600.0,
        help="seconds an episode may go unused before it is evicted (0: never)",
    )
    parser.add_argument(
        "--seed-wrap",
        action="store_true",
        help="map a seed above seed_max to seed mod (seed_max + 1) instead of refusing it",
    )
    parser.add_argument(
        "--rules-in-observation",
        action="store_true",
        help="also start each episode's first observation with its instruction (for clients "
        "that do not read /reset's `instruction`)",
    )
    parser.add_argument(
        "--no-oracle", action="store_true", help="send no oracle_action (saves its time per step)"
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")


class HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog: a rollout opens its connections at once (64 and more); the default of
    # 5 makes the kernel reset some of them.
    request_queue_size = 1024


def serve(name, backend, args):
    """Serves `backend` until interrupted; prints `serving NAME at http://HOST:PORT` once it
    listens (with --port 0 the system picks the port)."""
    episodes = Episodes(args.max_episodes, args.idle_timeout)
    server = Server(backend, episodes, args.seed_wrap)
    http = HubHTTPServer((args.host, args.port), handler(server, args.verbose))
    host, port = http.server_address[:2]
    print(f"serving {name} at http://{host}:{port}", flush=True)
    try:
        http.serve_forever()
    except KeyboardInterrupt:
        pass


def with_rules(instruction, observation, rules_in_observation):
    """The first observation, led by the episode's instruction when asked to."""
    if rules_in_observation and instruction:
        return f"{instruction.rstrip()}\n\n{observation}"
    return observation


def parser_for(doc):
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )


# Oracles: the next move of a fixed strategy that solves the game from the current state, sent as
# `oracle_action` (the action text the agent itself would send).


def hinted_interval(low, high, target, guesses):
    """GuessTheNumber: the numbers (low, high) the higher/lower hints to `guesses` leave."""
    for guess in guesses:
        if guess < target:
            low = max(low, guess + 1)
        elif guess > target:
            high = min(high, guess - 1)
    return low, high


def bisection_guess(low, high, target, guesses):
    """GuessTheNumber: the middle of the interval the higher/lower hints to `guesses` leave."""
    low, high = hinted_interval(low, high, target, guesses)
    return (low + high) // 2


def hanoi_first_move(towers, num_disks):
    """Tower of Hanoi: the first move of the shortest way from a legal position (`towers`: peg
    -> disks bottom to top, disks numbered 1 = smallest) to all disks on C, as "SRC DST"; None
    when solved."""
    where = {disk: peg for peg, disks in towers.items() for disk in disks}
    moves = []

    def solve(n, target):
        # Bring disks 1..n onto `target`, stopping at the first move.
        if n == 0 or moves:
            return
        if where[n] == target:
            solve(n - 1, target)
            return
        spare = ({"A", "B", "C"} - {where[n], target}).pop()
        solve(n - 1, spare)
        if not moves:
            moves.append(f"{where[n]} {target}")

    solve(num_disks, "C")
    return moves[0] if moves else None


def mastermind_pegs(code, guess):
    """(black, white) pegs of `guess` against `code`."""
    black = sum(c == g for c, g in zip(code, guess))
    common = sum(min(list(code).count(d), list(guess).count(d)) for d in set(guess))
    return black, common - black


def mastermind_next_guess(num_numbers, length, duplicates, code, guesses, cache):
    """Mastermind: the first code (in lexicographic order) consistent with the pegs every guess
    so far got, not guessed yet; `cache` (a dict kept with the episode) holds the codes still
    consistent. None when there is none."""
    if "codes" not in cache:
        digits = range(1, num_numbers + 1)
        if duplicates:
            codes = itertools.product(digits, repeat=length)
        else:
            codes = itertools.permutations(digits, length)
        cache["codes"], cache["seen"] = [tuple(c) for c in codes], set()
    for guess in map(tuple, guesses):
        if guess in cache["seen"]:
            continue
        pegs = mastermind_pegs(code, guess)
        cache["codes"] = [c for c in cache["codes"] if mastermind_pegs(c, guess) == pegs]
        cache["seen"].add(guess)
    fresh = [c for c in cache["codes"] if c not in cache["seen"]]
    return list(fresh[0]) if fresh else None


def grid_first_step(grid, start, goal, blocked, moves):
    """A shortest walk on a grid: the name of its first move from `start` to `goal` avoiding
    cells whose value is in `blocked` (`moves`: name -> (drow, dcol)); None when there is none."""
    rows, cols = len(grid), len(grid[0])
    first = {tuple(start): None}
    queue = [tuple(start)]
    for cell in queue:
        if cell == tuple(goal):
            return first[cell]
        for name, (dr, dc) in moves.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in first:
                if grid[nxt[0]][nxt[1]] in blocked:
                    continue
                first[nxt] = first[cell] or name
                queue.append(nxt)
    return None
