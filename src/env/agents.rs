//! Model-free agents and the episode loop. Agents answer with response *text* (e.g.
//! `<answer>Left</answer>`, `<search>q</search>`) that goes through the same
//! [`AgentSession::act`] parser as model output. `random` plays a uniform action; `oracle` plays
//! the env's best action (FrozenLake: BFS on the non-slippery map; Sokoban: the BFS solver;
//! Bandit: the better arm; QA: search each supporting title in turn, the first entity then the
//! bridge or second entity, then answer the gold answer); `searcher` (search envs only) plays
//! the oracle's searches, then answers with a guess (yes/no, one of a choice question's two
//! options, or a name it has read): a demonstration of the turn format and of searching that
//! leaves the answer to be learned. A remote env's oracle plays the action its server offers,
//! and its random agent draws among the listed or admissible actions; where the server offers
//! none, the agent answers with the env's error.

use std::str::FromStr;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{Action, AgentSession, EnvError, TurnOutcome};
use crate::tokenizer::tool_calls::{
    builtin_call_text, builtin_tool_results, ToolCall, ToolCallFormat,
};

/// Which model-free policy to play.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentKind {
    /// Plays a uniformly random action (`random`).
    Random,
    /// Plays the env's best action (`oracle`).
    Oracle,
    /// Search envs: the oracle's searches, then a guessed answer (`searcher`).
    Searcher,
}

impl AgentKind {
    /// The name configs and the CLI use.
    pub fn name(self) -> &'static str {
        match self {
            AgentKind::Random => "random",
            AgentKind::Oracle => "oracle",
            AgentKind::Searcher => "searcher",
        }
    }
}

impl AgentKind {
    /// Every agent, in the order configs document them.
    const ALL: [AgentKind; 3] = [AgentKind::Random, AgentKind::Oracle, AgentKind::Searcher];

    /// What the agent plays, as the config reference tells it.
    fn description(self) -> &'static str {
        match self {
            AgentKind::Random => {
                "A uniformly random action: its transcripts teach the answer format, not the task."
            }
            AgentKind::Oracle => {
                "The env's best action: FrozenLake's shortest path, Sokoban's BFS solution, the \
                 bandit's high-risk arm, HotpotQA's search for each supporting title in turn \
                 and then the answer (a remote env has none)."
            }
            AgentKind::Searcher => {
                "Search envs: the oracle's searches, then an answer guessed uniformly among \
                 yes/no for a question that opens like one, among the two options of a choice \
                 question (\"Who was born first, A or B?\"), else among the names in the \
                 question and in what it read: it teaches the turn format and searching, not \
                 the answer."
            }
        }
    }
}

/// The values a config's `sft.agent` takes (it is read as a string and parsed).
impl schemars::JsonSchema for AgentKind {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "AgentKind".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let described: Vec<serde_json::Value> = AgentKind::ALL
            .iter()
            .map(|a| serde_json::json!({ "const": a.name(), "description": a.description() }))
            .collect();
        schemars::json_schema!({ "type": "string", "oneOf": described })
    }
}

impl FromStr for AgentKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "random" => Ok(AgentKind::Random),
            "oracle" => Ok(AgentKind::Oracle),
            "searcher" => Ok(AgentKind::Searcher),
            other => Err(format!(
                "unknown agent `{other}` (known: random, oracle, searcher)"
            )),
        }
    }
}

/// A model-free agent with its own RNG.
pub struct Agent {
    kind: AgentKind,
    rng: ChaCha8Rng,
}

impl Agent {
    /// An agent of `kind` whose random choices come from a ChaCha8 RNG seeded with `seed`.
    pub fn new(kind: AgentKind, seed: u64) -> Self {
        Agent {
            kind,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The response text for the session's current turn; an error when the env has no such
    /// agent.
    pub fn respond(&mut self, session: &AgentSession) -> Result<String, EnvError> {
        let action = self.action(session)?;
        if session.protocol().tools {
            let call = super::tools::action_call(&action);
            let call = ToolCall::new("call_0", &call.name, &call.arguments);
            return Ok(builtin_call_text(None, &[call]));
        }
        Ok(response_text(&action, session.protocol().enable_think))
    }

    /// The action for the session's current turn (what a tool-mode turn calls); an error when
    /// the env has no such agent.
    pub fn action(&mut self, session: &AgentSession) -> Result<Action, EnvError> {
        match self.kind {
            AgentKind::Oracle => session.env().oracle_action(),
            AgentKind::Random => session.env().random_action(&mut self.rng),
            AgentKind::Searcher => session.env().searcher_action(&mut self.rng),
        }
    }
}

/// The tagged text that expresses `action`. A search query or a QA answer starts with a space
/// after its tag: the words it copies from the question and the passages carry their leading
/// space there, so a copied word is the same token as the one it copies (the env trims it).
pub fn response_text(action: &Action, enable_think: bool) -> String {
    let think = if enable_think {
        "<think>Choose the next action.</think>"
    } else {
        ""
    };
    match action {
        Action::Move(text) => format!("{think}<answer>{text}</answer>"),
        Action::Answer(text) => format!("{think}<answer> {text}</answer>"),
        Action::Search(query) => format!("{think}<search> {query}</search>"),
    }
}

/// One turn of a played episode.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnLog {
    /// The user message the turn answered (the observation, or in tool mode the previous
    /// turn's tool results).
    pub user_message: String,
    /// The agent's response text.
    pub response: String,
    /// What the env did with the response: reward, flags, next message.
    pub outcome: TurnOutcome,
}

/// A played episode.
#[derive(Clone, Debug, PartialEq)]
pub struct Episode {
    /// Tag of the env played (e.g. `frozen_lake`).
    pub env: String,
    /// Seed the env was reset with.
    pub seed: u64,
    /// The system prompt the session rendered.
    pub system_prompt: String,
    /// Every turn, in play order.
    pub turns: Vec<TurnLog>,
}

impl Episode {
    /// Whether the last turn ended in success.
    pub fn success(&self) -> bool {
        self.turns.last().is_some_and(|t| t.outcome.info.success)
    }

    /// Sum of turn rewards.
    pub fn reward(&self) -> f32 {
        self.turns.iter().map(|t| t.outcome.reward).sum()
    }

    /// Env actions executed.
    pub fn steps(&self) -> usize {
        self.turns
            .iter()
            .map(|t| t.outcome.info.num_actions as usize)
            .sum()
    }

    /// Human-readable transcript: observation, action and reward per turn.
    pub fn transcript(&self) -> String {
        let mut text = format!(
            "=== {} seed {} ===\n[system]\n{}\n",
            self.env, self.seed, self.system_prompt
        );
        for (i, turn) in self.turns.iter().enumerate() {
            let o = &turn.outcome;
            text.push_str(&format!(
                "[user {}]\n{}[assistant]\n{}\n[reward {} | valid {} | effective {} | terminated {} | truncated {}]\n",
                i + 1,
                turn.user_message,
                turn.response,
                o.reward,
                o.info.action_is_valid,
                o.info.action_is_effective,
                o.terminated,
                o.truncated
            ));
        }
        text.push_str(&format!(
            "=== success {} | reward {} | steps {} ===\n",
            self.success(),
            self.reward(),
            self.steps()
        ));
        text
    }
}

/// Plays one episode: `respond` writes the response text for each turn (in tool mode, calls in
/// the built-in template's Hermes format; their results are the next message). The first env (or agent)
/// error ends it.
pub fn play_episode(
    session: &mut AgentSession,
    seed: u64,
    respond: &mut dyn FnMut(&AgentSession) -> Result<String, EnvError>,
) -> Result<Episode, EnvError> {
    let mut user_message = session.reset(seed)?;
    let mut turns = Vec::new();
    loop {
        let response = respond(session)?;
        let outcome = match session.protocol().tools {
            true => {
                let reply = ToolCallFormat::Hermes.parse(&response, &session.tool_names());
                session.act_reply(&response, &reply)?
            }
            false => session.act(&response)?,
        };
        let next = match outcome.tool_results.is_empty() {
            true => outcome.next_user_message.clone(),
            false => Some(builtin_tool_results(
                outcome.tool_results.iter().map(String::as_str),
            )),
        };
        turns.push(TurnLog {
            user_message,
            response,
            outcome,
        });
        match next {
            Some(message) => user_message = message,
            None => break,
        }
    }
    Ok(Episode {
        env: session.env().tag().to_string(),
        seed,
        system_prompt: session.system_prompt(),
        turns,
    })
}
