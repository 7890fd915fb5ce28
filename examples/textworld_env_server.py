#!/usr/bin/env python3
"""Serve a pool of TextWorld games over stepppo's env bridge protocol (docs/guides/env-bridge.md).

    bash scripts/make_textworld_pool.sh pools/tw5 100      # 100 games: 5 rooms, 5-step quests
    python examples/textworld_env_server.py --pool pools/tw5 --port 8765

The seed picks the game: seed i plays the pool's i-th game (its files sorted by name), so
/spec's `seed_max` is the pool size - 1 and a larger seed is refused (400) unless the server runs
with --seed-wrap (then game seed mod pool size). A TextWorld game has no randomness of its own:
a seed always gives the same episode.

- `instruction` (/reset): the game's objective ("First stop, go to the south. ... take the
  keyboard from the type D locker."); /spec's `instruction` says what the games are like.
- `observation`: the game's text (its banner, prompt and status line removed), then
  `Location: ROOM. Score: S/MAX.` and `Admissible commands: a, b, c.`
- actions: free text (/spec `actions` is null); any command goes to the game's parser. The
  commands TextWorld knows to be admissible in the current state come in `admissible_actions`
  (/reset and /step answers, a list of strings) and in the observation; a step whose command is
  not among them has `action_is_valid: false`.
- `oracle_action`: the first command of the game's walkthrough from the current state
  (TextWorld's `policy_commands`, re-planned after every step).
- reward: the score gained by the step (the score is the quest's progress: dense with
  `tw-make tw-simple --rewards dense`, one or two points for `custom` games); `success` =
  the game is won; `terminated` = won or lost; `truncated` = --max-steps steps without either
  (/spec `max_steps`). `info.score` is the score so far.

Needs textworld (`STEPPPO_EXAMPLES_HUBS=1 bash scripts/examples_venv.sh`).
"""

import glob
import os
import re
import sys

import textworld
from textworld import EnvInfos

from hub_env_common import Backend, Episode, add_server_args, parser_for, serve, with_rules

INFOS = EnvInfos(
    admissible_commands=True,
    policy_commands=True,
    won=True,
    lost=True,
    max_score=True,
    score=True,
    objective=True,
)
INSTRUCTION = (
    "TextWorld: a text adventure. Explore the rooms, open containers and doors, take and put "
    "objects to complete the quest given at the start. Answer with one command, e.g. "
    "go north, open chest, take key from table, unlock door with key; each state lists its "
    "admissible commands."
)
STATUS = re.compile(r"-= (.*?) =-")


def game_command(action):
    """`action` as the game's parser may read it: characters outside printable ASCII (a NUL
    byte crashes the Z-machine interpreter, the whole server with it) become spaces, runs of
    spaces one; the parser answers what it cannot read as it answers any unknown command."""
    return " ".join(re.sub(r"[^\x20-\x7e]", " ", action).split())


def clean(text):
    """The game's text without its `>` prompt and status line, the end-of-game menu and runs of
    blank lines."""
    prompt = text.rfind("\n>")
    if prompt >= 0:
        text = text[:prompt]
    text = text.split("Would you like to RESTART", 1)[0]
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def location(text):
    """The room of the status line that closes a game text."""
    prompt = text.rfind("\n>")
    match = STATUS.search(text[prompt:]) if prompt >= 0 else None
    return match.group(1) if match else None


class TextWorldBackend(Backend):
    def __init__(self, pool, max_steps, oracle, rules_in_observation):
        games = glob.glob(os.path.join(pool, "*.z8")) + glob.glob(os.path.join(pool, "*.ulx"))
        games = sorted(games)
        games = [g for g in games if os.path.exists(os.path.splitext(g)[0] + ".json")]
        if not games:
            sys.exit(
                f"{pool}: no TextWorld games (*.z8 with their .json); make them with "
                f"bash scripts/make_textworld_pool.sh {pool}"
            )
        self.games = games
        self.max_steps = max_steps
        self.oracle = oracle
        self.rules_in_observation = rules_in_observation
        self.seed_why = f"the seed picks one of the pool's {len(games)} games"
        name = f"textworld:{os.path.basename(os.path.normpath(pool))}"
        self.spec = {
            "name": name,
            "instruction": INSTRUCTION,
            "actions": None,
            "max_steps": max_steps,
            "seed_max": len(games) - 1,
            "env_max_steps": None,
        }
        self.new_episode(0)[0].close()  # fail at start, not at the first reset

    def new_episode(self, seed):
        env = textworld.start(self.games[seed], request_infos=INFOS)
        state = env.reset()
        episode = Episode(env, seed)
        objective = (state["objective"] or "").strip()
        text = state.feedback
        if objective and objective in text:  # the banner and the objective lead the first text
            text = text.split(objective, 1)[1]
        episode.extra.update(score=state["score"] or 0, state=state)
        observation = self.render(clean(text), location(state.feedback), state)
        answer = {
            "observation": with_rules(objective, observation, self.rules_in_observation),
            "info": {"score": float(episode.extra["score"])},
            "instruction": objective,
        }
        self.add_extras(episode, answer, state)
        return episode, answer

    def render(self, text, room, state):
        lines = [text] if text else []
        status = f"Score: {state['score']}/{state['max_score']}."
        lines.append(f"Location: {room}. {status}" if room else status)
        commands = state["admissible_commands"] or []
        if commands:
            lines.append(f"Admissible commands: {', '.join(commands)}.")
        return "\n".join(lines)

    def step(self, episode, action):
        before = episode.extra["state"]
        command = game_command(action)
        admissible = {c.lower() for c in before["admissible_commands"] or []}
        state, score, done = episode.env.step(command)
        score = score or 0
        reward = float(score - episode.extra["score"])
        episode.extra.update(score=score, state=state)
        won, lost = bool(state["won"]), bool(state["lost"])
        terminated = bool(done) or won or lost  # the game ended (won, lost or quit)
        truncated = not terminated and episode.steps + 1 >= self.max_steps
        answer = {
            "observation": self.render(clean(state.feedback), location(state.feedback), state)
            if not terminated
            else clean(state.feedback),
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "info": {
                "success": won,
                "action_is_valid": command.lower() in admissible,
                "score": float(score),
            },
        }
        if not (terminated or truncated):
            self.add_extras(episode, answer, state)
        return answer

    def add_extras(self, episode, answer, state):
        answer["admissible_actions"] = list(state["admissible_commands"] or [])
        walkthrough = state["policy_commands"] or []
        if self.oracle and walkthrough:
            answer["oracle_action"] = walkthrough[0]


def main():
    parser = parser_for(__doc__)
    parser.add_argument(
        "--pool", required=True, help="a folder of games (scripts/make_textworld_pool.sh)"
    )
    parser.add_argument(
        "--max-steps", type=int, default=50, help="steps before an episode is truncated"
    )
    add_server_args(parser, max_episodes=1024)
    args = parser.parse_args()
    backend = TextWorldBackend(
        args.pool, args.max_steps, not args.no_oracle, args.rules_in_observation
    )
    serve(backend.spec["name"], backend, args)


if __name__ == "__main__":
    main()
