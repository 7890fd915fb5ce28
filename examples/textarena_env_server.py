#!/usr/bin/env python3
"""Serve a single-player TextArena game over stepppo's env bridge protocol
(docs/guides/env-bridge.md).

    python examples/textarena_env_server.py --env-id TowerOfHanoi-v0 --port 8765

Any single-player TextArena id (`GuessTheNumber-v0`, `TowerOfHanoi-v0`, `FrozenLake-v0`,
`Minesweeper-v0-small`, `Mastermind-v0`, `Sokoban-v0`, `LightsOut-v0`, ...; docs/guides/env-hubs.md
lists those that run offline). The server plays the id's "-raw" version (no TextArena wrappers)
and writes the text itself:

- the game's prompt (its rules) is the episode's `instruction` (/reset); /spec's `instruction` is
  the prompt of the episode of seed 0;
- each observation is only what is new since the agent's last move (TextArena's own
  observation is the whole transcript; the bridge keeps the conversation already), the agent's
  own move left out; the last one ends with TextArena's reason for the outcome;
- the agent sends the move itself ("A C", "up", "5", "3 2", "1 2 3 4"); the server writes it in
  square brackets, TextArena's format (an action that contains `[` is passed as it is). Games
  with a small fixed move set list it in /spec's `actions` (TowerOfHanoi: "A B".."C B";
  FrozenLake, Sokoban, FifteenPuzzle, 2048: "up", "down", "left", "right").

Rewards: TextArena scores an episode once, at its end (`env.close()`): 1 for a win, a fraction
for partial progress. That score is the last step's reward (0 before); `success` = score >= 1.
TextArena refuses an invalid move without ending the game (a second one in a row ends it): such
a step has `action_is_valid: false`.

`--describe-moves` (grid games: FrozenLake) ends each observation with what each listed move leads
to ("up: the edge, no move; down: a hole; ..."), as stepppo's own FrozenLake render `grid_local`
does: TextArena's ASCII board alone leaves a small model to learn to read a grid.

Determinism: TextArena seeds the process-wide `random` at reset and draws from it during play.
Each episode keeps its own state of it (and of numpy's), installed around every call into its
env (hub_env_common.GlobalRng), so a seed gives the same episode whatever runs concurrently.

Needs textarena (`STEPPPO_EXAMPLES_HUBS=1 bash scripts/examples_venv.sh`).
"""

import sys

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from hub_env_common import (
    SEED_LIMIT,
    Backend,
    DIRECTIONS,
    HANOI_MOVES,
    Episode,
    GlobalRng,
    add_server_args,
    bisection_guess,
    grid_first_step,
    hanoi_first_move,
    mastermind_next_guess,
    parser_for,
    serve,
)

LISTED_ACTIONS = {
    "TowerOfHanoiEnv": HANOI_MOVES,
    "FrozenLakeEnv": DIRECTIONS,
    "SokobanEnv": DIRECTIONS,
    "FifteenPuzzleEnv": DIRECTIONS,
    "Game2048Env": DIRECTIONS,
}
MOVE_EXAMPLES = {
    "GuessTheNumberEnv": "7",
    "MastermindEnv": "1 2 3 4",
    "MinesweeperEnv": "3 2",
    "LightsOutEnv": "2 3",
    "SudokuEnv": "1 1 5",
    "CrosswordsEnv": "0 0 d",
    "PegJumpEnv": "4 1",
    "RushHourEnv": "A+",
    "CountdownEnv": "0 2 *",
    "LogicPuzzleEnv": "park Alice X",
}
GRID_MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
ObservationType = ta.ObservationType


def message(entry):
    """(text, ObservationType) of a TextArena message (from_id, text, type); some games
    (Countdown) add theirs in another order."""
    text = next((x for x in entry if isinstance(x, str)), "")
    kind = next((x for x in entry if isinstance(x, ObservationType)), ObservationType.GAME_MESSAGE)
    return text, kind


def raw_id(env_id):
    """The registry id of `env_id` without TextArena's wrappers (its "-raw" version)."""
    base = env_id
    for suffix in ("-raw", "-train"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    for candidate in (base + "-raw", base):
        if candidate in ENV_REGISTRY:
            return candidate
    sys.exit(f"{env_id}: not a TextArena id (e.g. GuessTheNumber-v0, TowerOfHanoi-v0)")


GRID_CELLS = {"H": "a hole", "G": "the goal"}


def move_outcomes(grid, pos):
    """What each grid move leads to from `pos`: the edge (no move), a hole, the goal or ice."""
    parts = []
    for name, (dr, dc) in GRID_MOVES.items():
        r, c = pos[0] + dr, pos[1] + dc
        if not (0 <= r < len(grid) and 0 <= c < len(grid[0])):
            parts.append(f"{name}: the edge, no move")
        else:
            parts.append(f"{name}: {GRID_CELLS.get(grid[r][c], 'frozen ice')}")
    return "What each move leads to: " + "; ".join(parts) + "."


class TextArenaBackend(Backend):
    def __init__(self, env_id, oracle, rules_in_observation, describe_moves=False):
        self.env_id = env_id
        self.make_id = raw_id(env_id)
        self.oracle = oracle
        self.rules_in_observation = rules_in_observation
        self.describe_moves = describe_moves
        self.seed_why = "TextArena seeds Python's random, which takes any seed"
        try:
            probe, prompt, _ = self.make(0)
        except Exception as e:
            sys.exit(f"{env_id}: make/reset failed: {type(e).__name__}: {e}")
        self.kind = type(probe).__name__
        if describe_moves and self.kind != "FrozenLakeEnv":
            sys.exit(f"{env_id}: --describe-moves serves grid games (FrozenLake), not {self.kind}")
        self.code_length = getattr(probe, "code_length", 4)
        self.actions = LISTED_ACTIONS.get(self.kind)
        max_turns = getattr(probe.state, "max_turns", None)
        self.spec = {
            "name": env_id,
            "instruction": self.instruction(prompt),
            "actions": self.actions,
            # TextArena counts valid moves only (an invalid one is refused once and retried), so
            # its limit is no cap on the bridge's actions.
            "max_steps": None,
            "seed_max": SEED_LIMIT,
            "env_max_steps": int(max_turns) if max_turns else None,
        }

    def make(self, seed):
        """A new env reset with `seed` under `seed`'s RNG: (env, prompt, first messages)."""
        rng = GlobalRng(seed)
        with rng.active():
            env = ta.make(self.make_id)
            env.reset(num_players=1, seed=seed)
            _, messages = env.get_observation()
        env.ta_rng = rng
        messages = [message(m) for m in messages]
        prompt = "\n".join(m for m, kind in messages if kind == ObservationType.PROMPT)
        rest = [(m, kind) for m, kind in messages if kind != ObservationType.PROMPT]
        return env, prompt, rest

    def instruction(self, prompt):
        example = self.actions[0] if self.actions else MOVE_EXAMPLES.get(self.kind, "your move")
        if self.kind == "MastermindEnv":  # as long as this id's code
            example = " ".join(str(i + 1) for i in range(self.code_length))
        note = (
            f"Answer with the move alone (e.g. {example}); the server writes it in square "
            f"brackets for the game."
        )
        return f"{prompt.rstrip()}\n{note}"

    @staticmethod
    def text(messages):
        """The messages an agent reads, its own move left out."""
        return "\n".join(
            m.strip() for m, kind in messages if kind != ObservationType.PLAYER_ACTION and m.strip()
        )

    def new_episode(self, seed):
        env, prompt, messages = self.make(seed)
        episode = Episode(env, seed)
        instruction = self.instruction(prompt)
        observation = self.text(messages) or "The game begins: make your first move."
        observation = self.with_moves(env, observation)
        return episode, self.first_answer(
            episode, instruction, observation, self.rules_in_observation
        )

    def bracketed(self, action):
        name = self.listed_action(action)
        if name is not None:
            return f"[{name}]"
        text = action.strip()
        return text if "[" in text else f"[{text}]"

    def step(self, episode, action):
        env = episode.env
        move = self.bracketed(action)
        with env.ta_rng.active():
            done, _ = env.step(move)
            _, messages = env.get_observation()
            outcome = env.close() if done else None
        state = env.state
        observation = self.text([message(m) for m in messages])
        reward, success, invalid = 0.0, False, getattr(state, "error_count", 0) > 0
        if done:
            rewards, game_info = outcome
            reward = float((rewards or {}).get(0, 0.0))
            success = reward >= 1.0
            player = (game_info or {}).get(0, {})
            invalid = invalid or bool(player.get("invalid_move"))
            reason = player.get("reason")
            if reason:
                observation = f"{observation}\n{reason}".strip()
        answer = {
            "observation": observation or "(no change)",
            "reward": reward,
            # The turn limit is a rule of the game (stated in its prompt, scored by it).
            "terminated": bool(done),
            "truncated": False,
            "info": {"success": success, "action_is_valid": not invalid},
        }
        if not done:
            answer["observation"] = self.with_moves(env, answer["observation"])
            self.add_oracle(episode, answer)
        return answer

    def with_moves(self, env, observation):
        """`observation`, and with --describe-moves what each move leads to from here."""
        if not self.describe_moves:
            return observation
        game = env.state.game_state
        return f"{observation}\n{move_outcomes(game['grid'], game['player_pos'])}"

    def oracle_action(self, episode):
        env = episode.env
        game = env.state.game_state
        if self.kind == "GuessTheNumberEnv":
            return str(
                bisection_guess(
                    env.min_number, env.max_number, env.game_number, env.guessed_numbers
                )
            )
        if self.kind == "TowerOfHanoiEnv":
            return hanoi_first_move(game["towers"], env.num_disks)
        if self.kind == "FrozenLakeEnv":
            return grid_first_step(
                game["grid"], game["player_pos"], game["goal_pos"], {"H"}, GRID_MOVES
            )
        if self.kind == "MastermindEnv":
            guess = mastermind_next_guess(
                game["num_numbers"],
                game["code_length"],
                game["duplicate_numbers"],
                game["secret_code"],
                [entry["guess"] for entry in game["history"]],
                episode.extra,
            )
            return " ".join(map(str, guess)) if guess else None
        return None


def main():
    parser = parser_for(__doc__)
    parser.add_argument(
        "--env-id", default="GuessTheNumber-v0", help="a single-player TextArena id"
    )
    parser.add_argument(
        "--describe-moves",
        action="store_true",
        help="end each observation with what each move leads to (grid games: FrozenLake)",
    )
    add_server_args(parser)
    args = parser.parse_args()
    backend = TextArenaBackend(
        args.env_id, not args.no_oracle, args.rules_in_observation, args.describe_moves
    )
    serve(args.env_id, backend, args)


if __name__ == "__main__":
    main()
