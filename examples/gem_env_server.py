#!/usr/bin/env python3
"""Serve a GEM game (gem-llm) over stepppo's env bridge protocol (docs/guides/env-bridge.md).

    python examples/gem_env_server.py --env-id game:GuessTheNumber-v0-easy --port 8765

Any `gem.make` id works (`game:GuessTheNumber-v0-easy`, `game:TowerofHanoi-v0-easy`,
`game:Sokoban-v0-easy`, `game:Mastermind-v0-easy`, `game:Minesweeper-v0-easy`, ...);
docs/guides/env-hubs.md lists those that run offline. The agent sends the move itself ("7",
"A C", "up", "reveal 3 2", "1 2 3 4"); the server writes it inside `\\boxed{...}` as GEM wants
(an action that already contains `\\boxed{` is passed as it is). Games with a small fixed move
set list it in /spec's `actions` (TowerofHanoi: "A B".."C B"; Sokoban, Game2048, FifteenPuzzle:
"up", "down", "left", "right"; GuessTheNumber with a fixed range of at most 100 numbers: "1".."10"
for -easy, "1".."50" for -hard), so `constrained_decoding: true` applies; the others take free
text.

`--describe-state` (GuessTheNumber) ends each observation with the numbers the higher/lower hints
so far leave ("The hints so far leave 4 to 7."): the game's state, which otherwise has to be read
off the whole transcript.

`--reward win` pays 1 for the winning move and 0 for every other (GEM's own rewards include
partial scores at a game's turn limit, which an agent can learn to collect without winning).

Besides the protocol's fields, answers carry the additions of docs/guides/env-hubs.md: /spec
`seed_max` (2**32 - 1: GEM seeds numpy's global RNG) and `env_max_steps` (the game's own turn
limit); /reset `instruction` (the episode's rules: GEM writes them per seed) and, for
GuessTheNumber, TowerofHanoi and Mastermind, `oracle_action` in /reset and /step.

Determinism: GEM draws from the process-wide `random` and numpy RNGs, during play too
(Minesweeper places its mines at the first reveal). Each episode keeps its own state of both,
installed around every call into its env (hub_env_common.GlobalRng), so a seed gives the same
episode whatever runs concurrently.

Needs gem-llm (`STEPPPO_EXAMPLES_HUBS=1 bash scripts/examples_venv.sh`).
"""

import json
import re
import sys

import gem

from hub_env_common import (
    Backend,
    DIRECTIONS,
    HANOI_MOVES,
    Episode,
    GlobalRng,
    add_server_args,
    bisection_guess,
    hinted_interval,
    hanoi_first_move,
    mastermind_next_guess,
    parser_for,
    serve,
)

LISTED_ACTIONS = {
    "TowerofHanoiEnv": HANOI_MOVES,
    "SokobanEnv": DIRECTIONS,
    "Game2048Env": DIRECTIONS,
    "FifteenPuzzleEnv": DIRECTIONS,
}
# What each game's free-text move looks like (for the instruction's note, when GEM's rules give
# no example).
MOVE_EXAMPLES = {
    "GuessTheNumberEnv": "7",
    "MastermindEnv": "1 2 3 4",
    "MinesweeperEnv": "reveal 3 2",
    "SudokuEnv": "1 1 5",
    "WordleEnv": "crane",
    "HangmanEnv": "e",
    "WordSearchEnv": "1 1 1 5",
}
# GEM's feedback for a move it refuses without ending the game (a repeated guess, a wall, ...).
INVALID_FEEDBACK = re.compile(
    r"outside the|already|invalid|which is empty|larger than the top disk|would collide|"
    r"doesn't change|out of bounds|violates|entries but the code|not valid|did not provide"
)
FORMAT_ERROR_REWARD = -0.1  # gem.utils.constants.LanguageGameReward.format_error_reward
# The largest GuessTheNumber range listed as actions (larger ranges take free text).
MAX_LISTED_NUMBERS = 100
SEED_MAX = 2**32 - 1  # gem.utils.seeding.set_seed -> np.random.seed: seeds must fit 32 bits


def listed_numbers(game, fixed):
    """GuessTheNumber's guesses when its range is fixed and small: "1".."10" (easy), "1".."50"
    (hard); None for the `-random` ids, whose range changes per episode."""
    if type(game).__name__ != "GuessTheNumberEnv" or not fixed:
        return None
    if game.max_number - game.min_number + 1 > MAX_LISTED_NUMBERS:
        return None
    return [str(n) for n in range(game.min_number, game.max_number + 1)]


class GemBackend(Backend):
    def __init__(
        self, env_id, make_kwargs, oracle, rules_in_observation, reward="game", describe=False
    ):
        self.env_id = env_id
        self.reward_mode = reward
        self.describe_state = describe
        self.make_kwargs = make_kwargs
        self.oracle = oracle
        self.rules_in_observation = rules_in_observation
        self.seed_why = "GEM seeds numpy's global RNG, which takes 32-bit seeds"
        try:
            probe, rules, _ = self.make(0)
        except Exception as e:
            sys.exit(f"{env_id}: gem.make/reset failed: {type(e).__name__}: {e}")
        self.kind = type(probe.unwrapped).__name__
        if describe and self.kind != "GuessTheNumberEnv":
            sys.exit(f"{env_id}: --describe-state serves GuessTheNumber, not {self.kind}")
        fixed = not getattr(probe.unwrapped, "_is_random", False)
        self.actions = LISTED_ACTIONS.get(self.kind) or listed_numbers(probe.unwrapped, fixed)
        max_turns = getattr(probe.unwrapped, "max_turns", None) if fixed else None
        self.spec = {
            "name": env_id,
            "instruction": self.instruction(rules),
            "actions": self.actions,
            # Every GEM step is one of the game's turns: the bridge's action budget is its limit.
            "max_steps": max_turns,
            "seed_max": SEED_MAX,
            "env_max_steps": max_turns,
        }

    def make(self, seed):
        """A new env reset with `seed`, its rules text and its board text, under `seed`'s RNG."""
        rng = GlobalRng(seed)
        with rng.active():
            env = gem.make(self.env_id, **self.make_kwargs)
            rules, info = env.reset(seed=seed)
        env.gem_rng = rng
        return env, rules, (info or {}).get("suffix", "")

    def instruction(self, rules):
        """GEM's rules, and how the agent writes a move here (the server adds the \\boxed{})."""
        if self.actions:
            example = self.actions[0]
        else:  # GEM's own example move in these rules, else a typical one
            boxed = [m.strip() for m in re.findall(r"\\boxed\{([^{}]*)\}", rules)]
            boxed = [m for m in boxed if m and m != "..."]
            boxed.sort(key=lambda m: not re.search(r"\d", m))  # "1 1 5" before "row column"
            example = boxed[0] if boxed else MOVE_EXAMPLES.get(self.kind, "your move")
        note = (
            f"Answer with the move alone (e.g. {example}); the server writes it inside "
            f"\\boxed{{}} for the game."
        )
        return f"{rules.rstrip()}\n{note}"

    def new_episode(self, seed):
        env, rules, board = self.make(seed)
        episode = Episode(env, seed)
        instruction = self.instruction(rules)
        observation = board.strip() or "The game begins: make your first move."
        observation = self.described(episode, observation)
        return episode, self.first_answer(
            episode, instruction, observation, self.rules_in_observation
        )

    def boxed(self, action):
        name = self.listed_action(action)
        if name is not None:
            return "\\boxed{" + name + "}"
        text = action.strip()
        if "\\boxed{" in text:
            return text
        return "\\boxed{" + text + "}"

    def step(self, episode, action):
        env = episode.env
        move = self.boxed(action)
        with env.gem_rng.active():
            feedback, reward, terminated, truncated, info = env.step(move)
        reward = float(reward)
        format_error = terminated and reward == FORMAT_ERROR_REWARD
        valid = not format_error and not INVALID_FEEDBACK.search(feedback)
        success = feedback.startswith("Congratulations")
        if self.reward_mode == "win":
            # Only a won game pays: GEM's partial scores (GuessTheNumber pays 1 - distance/range
            # at its turn limit) reward getting close without winning.
            reward = 1.0 if success else 0.0
        # GEM ends a game at its own turn limit with terminated = truncated = True and pays its
        # final score (GuessTheNumber 1 - distance/range, Sokoban boxes on targets, ...). That
        # limit is a rule of the game, stated in its rules: the bridge reports it as terminated.
        done = bool(terminated or truncated)
        observation = feedback.strip()
        board = (info or {}).get("suffix", "")
        if not done and board:
            observation = f"{observation}\n{board.strip()}"
        if not done:
            observation = self.described(episode, observation)
        answer = {
            "observation": observation,
            "reward": reward,
            "terminated": done,
            "truncated": False,
            "info": {
                "success": success,
                "action_is_valid": valid,
                "format_error": format_error,
                "turn_limit": bool(truncated),
            },
        }
        if not done:
            self.add_oracle(episode, answer)
        return answer

    def described(self, episode, observation):
        """`observation`, and with --describe-state the numbers the hints so far leave."""
        if not self.describe_state:
            return observation
        game = episode.env.unwrapped
        low, high = hinted_interval(
            game.min_number, game.max_number, game.game_number, game.previous_guesses
        )
        return f"{observation}\nThe hints so far leave {low} to {high}."

    def oracle_action(self, episode):
        game = episode.env.unwrapped
        if self.kind == "GuessTheNumberEnv":
            guess = bisection_guess(
                game.min_number, game.max_number, game.game_number, game.previous_guesses
            )
            return str(guess)
        if self.kind == "TowerofHanoiEnv":
            return hanoi_first_move(game.board, game.num_disks)
        if self.kind == "MastermindEnv":
            guess = mastermind_next_guess(
                game.num_numbers,
                game.code_length,
                game.duplicate_numbers,
                game.game_code,
                [list(g) for g in game.previous_guesses],
                episode.extra,
            )
            return " ".join(map(str, guess)) if guess else None
        return None


def main():
    parser = parser_for(__doc__)
    parser.add_argument(
        "--env-id", default="game:GuessTheNumber-v0-easy", help="a gem.make id (game:...)"
    )
    parser.add_argument("--make", default="{}", help="gem.make keyword arguments, as JSON")
    parser.add_argument(
        "--reward",
        choices=["game", "win"],
        default="game",
        help="game: GEM's rewards as they are (partial scores, format penalties); "
        "win: 1 when the move wins the game, else 0",
    )
    parser.add_argument(
        "--describe-state",
        action="store_true",
        help="GuessTheNumber: end each observation with the numbers the hints so far leave "
        '("The hints so far leave 4 to 7."), so the state is in the observation, not only in '
        "the transcript",
    )
    add_server_args(parser)
    args = parser.parse_args()
    backend = GemBackend(
        args.env_id,
        json.loads(args.make),
        not args.no_oracle,
        args.rules_in_observation,
        args.reward,
        args.describe_state,
    )
    serve(args.env_id, backend, args)


if __name__ == "__main__":
    main()
