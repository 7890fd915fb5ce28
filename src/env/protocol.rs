//! The agent text protocol over one env: the system prompt, the first user message
//! (instruction + turn 1), the per-turn messages (`Turn k:\nState:\n…\nYou have N actions left.`),
//! parsing of the model's text (`<think>…</think><answer>…</answer>`, `<search>…</search>` for
//! QA, several actions split on `||`), the format penalty and the turn/step limits.
//!
//! Invalid or unparseable turn (differs from both references, by design): the env is **not**
//! stepped (state unchanged), the turn counts toward `max_turns`, its reward is
//! `format_penalty` and `action_is_valid` is false. RAGEN drops invalid actions and charges −0.1
//! once per turn; ROLL Sokoban turns an invalid action into a no-op step costing −0.1. A turn with
//! any unknown action name is invalid as a whole; actions beyond `max_actions_per_turn` are
//! dropped (as RAGEN does). Malformed text never panics.
//!
//! In tool mode (`tools: true`) the actions are offered as functions ([`super::tools`]): the
//! caller finds the calls in the reply (the format is the chat template's) and hands them to
//! [`AgentSession::act_reply`]; each executed call's result is the next turn's tool message.
//!
//! An env that fails (a remote server's error) makes `reset` or `act` return its [`EnvError`]
//! and ends the episode (`is_done`): nothing is made up for the turn that failed.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::tools;
use super::{stable_hash, Action, ActionSpace, Env, EnvError};
use crate::tokenizer::tool_calls::{ParsedCall, ParsedReply};
use crate::tokenizer::Followup;

/// Human-readable and per-step environment facts carried with a record.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepInfo {
    /// The episode is solved at (or before) the end of this step.
    pub success: bool,
    /// Every action parsed from the response was valid.
    pub action_is_valid: bool,
    /// At least one action changed the environment state.
    pub action_is_effective: bool,
    /// Format penalty included in `reward` (0 when the response was well formed).
    pub format_penalty: f32,
    /// Number of env actions executed in this round.
    pub num_actions: u32,
    /// The observation text shown to the agent at the start of this step.
    pub observation_text: String,
    /// The response text the agent produced (decoded from `response_ids`).
    pub action_text: String,
    /// The response held text that looked like a tool call but did not parse as one (the
    /// OpenAI-compatible gateway returns such text as plain content and records this flag).
    /// False in records read from segments of format versions before 5.
    #[serde(default)]
    pub tool_call_error: bool,
    /// This step's context was re-rendered from the client's message history, because that
    /// history did not continue the tokens already sampled in the trajectory (edited history,
    /// or a chat template that re-renders past turns differently): the step starts a fresh
    /// context (`context_len` 0) although it is not the trajectory's first step. False in
    /// records read from segments of format versions before 5.
    #[serde(default)]
    pub context_rebuilt: bool,
}

/// How the agent talks to the env: the protocol keys every env config takes next to the env's
/// own keys. An invalid or unparseable turn does not step the env, counts toward `max_turns`,
/// is paid `format_penalty` and is marked `(invalid answer)` in the next message; a turn with
/// any unknown action name is invalid as a whole.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProtocolConfig {
    /// Turns (model responses) per episode; at least 1. Defaults: 10 for FrozenLake (one action
    /// per turn, as ROLL), 1 for bandit, 4 for hotpotqa, 10 for remote; unset for Sokoban,
    /// enough turns for its action cap `max_steps` (⌈`max_steps` / `max_actions_per_turn`⌉),
    /// which a value set for Sokoban may not undercut.
    pub max_turns: usize,
    /// Actions executed per turn, separated by `||` in one answer; extra actions are dropped.
    /// At least 1. RAGEN uses 5, ROLL 1.
    pub max_actions_per_turn: usize,
    /// Require `<think>…</think>` before the answer (off by default: the embedded model is tiny).
    pub enable_think: bool,
    /// Reward of an invalid or unparseable turn (RAGEN −0.1); finite.
    pub format_penalty: f32,
    /// Write each turn's reward into the next user message (`Reward: r`) and the window history.
    /// `false` leaves the line out: the agent is told only that a turn was invalid, so shaping
    /// paid in training only (such as HotpotQA's `retrieval_bonus`) never makes the training
    /// text differ from validation's.
    pub show_reward: bool,
    /// Tool mode (OpenAI function calling): the env's actions are offered as functions
    /// (`search(query)` and `answer(answer)` for search QA, `act(action)` for named actions), the
    /// chat template renders them into the prompt, the model answers by calling one, and each
    /// executed call's result comes back as a tool message (no `Turn k:` blocks). A reply with no
    /// call, or one that does not parse, is an invalid turn (`tool_call_error` when it tried).
    /// The format of an agent served through the gateway; needs `context: concat`.
    pub tools: bool,
}

impl ProtocolConfig {
    /// The keys of this config, used to split a combined env config.
    pub const KEYS: [&'static str; 6] = [
        "max_turns",
        "max_actions_per_turn",
        "enable_think",
        "format_penalty",
        "show_reward",
        "tools",
    ];

    /// Defaults for an env.
    pub fn default_for(env_name: &str) -> Self {
        let max_turns = match env_name {
            "bandit" => 1,
            "hotpotqa" => 4,
            _ => 10,
        };
        ProtocolConfig {
            max_turns,
            max_actions_per_turn: 1,
            enable_think: false,
            format_penalty: -0.1,
            show_reward: true,
            tools: false,
        }
    }

    pub(crate) fn validate(&self, env_name: &str) -> Result<(), EnvError> {
        if self.max_turns == 0 {
            return Err(super::bad_value(
                env_name,
                "max_turns",
                "must be at least 1",
            ));
        }
        if self.max_actions_per_turn == 0 {
            return Err(super::bad_value(
                env_name,
                "max_actions_per_turn",
                "must be at least 1",
            ));
        }
        if !self.format_penalty.is_finite() {
            return Err(super::bad_value(
                env_name,
                "format_penalty",
                "must be finite",
            ));
        }
        Ok(())
    }
}

/// What one `act` produced.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnOutcome {
    /// Sum of the executed actions' rewards, or the format penalty for an invalid turn.
    pub reward: f32,
    /// The env reached a terminal state this turn.
    pub terminated: bool,
    /// The episode was cut without a terminal state: by the env, `max_turns` or the env's action
    /// budget (`max_steps`).
    pub truncated: bool,
    /// The next user message; `None` when the episode is over, and in tool mode when the turn
    /// executed calls (their results are the next message).
    pub next_user_message: Option<String>,
    /// Tool mode: the result of each executed call, in order (the next turn's tool messages);
    /// empty when the episode is over or nothing was executed.
    pub tool_results: Vec<String>,
    /// The step's flags and texts, as its record stores them.
    pub info: StepInfo,
    /// Env metrics of the last executed action (e.g. `em`, `f1` for QA); empty when none ran.
    pub metrics: Vec<(String, f32)>,
}

impl TurnOutcome {
    /// What follows the turn in the conversation: the next user message, or in tool mode the
    /// executed calls' results; `None` when the episode is over.
    pub fn followup(&self) -> Option<Followup<'_>> {
        match (&self.next_user_message, self.tool_results.is_empty()) {
            (Some(user), _) => Some(Followup::User(user)),
            (None, false) => Some(Followup::ToolResults(&self.tool_results)),
            (None, true) => None,
        }
    }
}

/// One finished turn, kept for the re-rendered (window) layout.
#[derive(Clone, Debug)]
struct Round {
    state: String,
    response: String,
    reward: f32,
}

/// An env plus the text protocol: what the LLM sees and how its text is parsed.
pub struct AgentSession {
    env: Box<dyn Env>,
    protocol: ProtocolConfig,
    /// 1-based index of the turn awaiting a response.
    turn: usize,
    actions_used: usize,
    done: bool,
    /// Raw observation at the start of the current turn.
    turn_state: String,
    history: Vec<Round>,
}

impl AgentSession {
    /// Wraps `env` in the text protocol `protocol`; the first episode starts at [`Self::reset`].
    pub fn new(env: Box<dyn Env>, protocol: ProtocolConfig) -> Self {
        AgentSession {
            env,
            protocol,
            turn: 1,
            actions_used: 0,
            done: true,
            turn_state: String::new(),
            history: Vec::new(),
        }
    }

    /// The wrapped env.
    pub fn env(&self) -> &dyn Env {
        self.env.as_ref()
    }

    /// The protocol settings.
    pub fn protocol(&self) -> &ProtocolConfig {
        &self.protocol
    }

    /// Whether the episode is over (also true before the first `reset`).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// 1-based index of the turn awaiting a response.
    pub fn turn(&self) -> usize {
        self.turn
    }

    /// Env actions executed so far in this episode.
    pub fn actions_used(&self) -> usize {
        self.actions_used
    }

    /// The system message: the reply format to follow (answer tags, search or answer tags, or a
    /// tool call).
    pub fn system_prompt(&self) -> String {
        if self.protocol.tools {
            return "You're a helpful assistant. Each turn, call one of the functions offered, \
                    with no extra text."
                .to_string();
        }
        let think = if self.protocol.enable_think {
            "<think>[your thoughts]</think>"
        } else {
            ""
        };
        match self.env.action_space() {
            ActionSpace::Named(_) | ActionSpace::FreeText => format!(
                "You're a helpful assistant. Always reply {think}<answer>[your answer]</answer> with no extra text."
            ),
            ActionSpace::SearchOrAnswer => format!(
                "You're a helpful assistant. Always reply {think}<search>[query]</search> to search, or {think}<answer>[your answer]</answer> to answer, with no extra text."
            ),
        }
    }

    /// Starts an episode; returns the first user message (instruction + turn 1 state).
    pub fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        self.done = true;
        self.turn_state = self.env.reset(seed)?;
        self.turn = 1;
        self.actions_used = 0;
        self.done = false;
        self.history.clear();
        if self.protocol.tools {
            let state = self.turn_state.trim_matches('\n');
            return Ok(format!("{}\n{state}", self.env.tool_instruction()));
        }
        Ok(format!("{}\n{}", self.instruction(), self.turn_block()))
    }

    /// Tool mode: the functions offered, each as the JSON text of an OpenAI tool; empty in the
    /// text protocol.
    pub fn tool_schemas(&self) -> Vec<String> {
        match self.protocol.tools {
            true => tools::tool_schemas(&self.env.action_space()),
            false => Vec::new(),
        }
    }

    /// Tool mode: the names of the functions offered.
    pub fn tool_names(&self) -> Vec<&'static str> {
        tools::function_names(&self.env.action_space())
    }

    /// Tool mode: applies a reply, `reply` being what the tokenizer's tool-call format found in
    /// `response_text`. Up to `max_actions_per_turn` calls run in order; a reply that calls
    /// nothing is an invalid turn, and one whose call did not parse or stands for no action is an
    /// invalid turn flagged `tool_call_error`.
    pub fn act_reply(
        &mut self,
        response_text: &str,
        reply: &ParsedReply,
    ) -> Result<TurnOutcome, EnvError> {
        let space = self.env.action_space();
        let actions = match reply {
            ParsedReply::Malformed { reason } => Err(reason.clone()),
            ParsedReply::Content => Ok(None),
            ParsedReply::Calls { calls, .. } => calls
                .iter()
                .take(self.protocol.max_actions_per_turn)
                .map(|c: &ParsedCall| tools::call_action(&space, c))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
        };
        let tried = actions.is_err();
        let mut outcome = self.apply(response_text, actions.ok().flatten())?;
        outcome.info.tool_call_error = tried;
        Ok(outcome)
    }

    /// Parses `response_text`, steps the env (or applies the format penalty), advances the turn.
    /// An env error ends the episode.
    pub fn act(&mut self, response_text: &str) -> Result<TurnOutcome, EnvError> {
        let parsed = parse_response(
            response_text,
            &self.env.action_space(),
            self.protocol.enable_think,
            self.protocol.max_actions_per_turn,
        );
        self.apply(response_text, parsed)
    }

    /// Steps the env with the actions a reply stands for (`None`: an invalid turn, which pays
    /// the format penalty), advances the turn and writes the next message.
    fn apply(
        &mut self,
        response_text: &str,
        parsed: Option<Vec<Action>>,
    ) -> Result<TurnOutcome, EnvError> {
        let observation_text = self.turn_state.clone();
        if self.done {
            return Ok(TurnOutcome {
                reward: 0.0,
                terminated: true,
                truncated: false,
                next_user_message: None,
                tool_results: Vec::new(),
                info: StepInfo {
                    observation_text,
                    action_text: response_text.to_string(),
                    ..StepInfo::default()
                },
                metrics: Vec::new(),
            });
        }
        let mut info = StepInfo {
            observation_text,
            action_text: response_text.to_string(),
            ..StepInfo::default()
        };
        let mut metrics = Vec::new();
        let mut results = Vec::new();
        let (reward, terminated, env_truncated) = match parsed {
            Some(actions) => match self.execute(&actions, &mut info, &mut metrics, &mut results) {
                Ok(result) => result,
                Err(e) => {
                    self.done = true;
                    return Err(e);
                }
            },
            None => {
                info.format_penalty = self.protocol.format_penalty;
                (self.protocol.format_penalty, false, false)
            }
        };
        self.history.push(Round {
            state: std::mem::take(&mut self.turn_state),
            response: response_text.to_string(),
            reward,
        });
        self.turn_state = self.env.state_text();
        self.turn += 1;
        let truncated = !terminated
            && (env_truncated
                || self.turn > self.protocol.max_turns
                || self.actions_used >= self.env.max_steps());
        self.done = terminated || truncated;
        let (next_user_message, tool_results) = match (self.done, self.protocol.tools) {
            (true, _) => (None, Vec::new()),
            (false, true) if !results.is_empty() => (None, results),
            (false, true) => (Some(self.invalid_call_message()), results),
            (false, false) => (
                Some(format!(
                    "{}{}",
                    self.feedback_line(reward, info.action_is_valid),
                    self.turn_block()
                )),
                Vec::new(),
            ),
        };
        Ok(TurnOutcome {
            reward,
            terminated,
            truncated,
            next_user_message,
            tool_results,
            info,
            metrics,
        })
    }

    /// Tool mode: the user message after a turn that executed no call.
    fn invalid_call_message(&self) -> String {
        format!(
            "(invalid turn) Call one of the functions offered: {}.",
            self.tool_names().join(", ")
        )
    }

    /// The line that opens the next user message: the reward (when shown) and whether the turn
    /// was invalid.
    fn feedback_line(&self, reward: f32, valid: bool) -> String {
        match (self.protocol.show_reward, valid) {
            (true, true) => format!("Reward: {reward}\n"),
            (true, false) => format!("Reward: {reward} (invalid answer)\n"),
            (false, true) => String::new(),
            (false, false) => "(invalid answer)\n".to_string(),
        }
    }

    /// Stable hash of the raw observation at the start of the current turn (GiGPO anchor).
    pub fn state_hash(&self) -> u64 {
        stable_hash(self.turn_state.as_bytes())
    }

    /// The raw observation at the start of the current turn.
    pub fn state_text(&self) -> &str {
        &self.turn_state
    }

    /// The prompt re-rendered for the window layout: instruction, the last `k` rounds
    /// (state, response, reward), then the current turn.
    pub fn window_user_message(&self, k: usize) -> String {
        let start = self.history.len().saturating_sub(k);
        let mut text = format!("{}\n", self.instruction());
        if start < self.history.len() {
            text.push_str("Recent history:\n");
        }
        for (i, round) in self.history.iter().enumerate().skip(start) {
            text.push_str(&format!(
                "Turn {}:\nState:\n{}\nResponse: {}\n",
                i + 1,
                round.state.trim_matches('\n'),
                round.response,
            ));
            if self.protocol.show_reward {
                text.push_str(&format!("Reward: {}\n", round.reward));
            }
        }
        text.push_str(&self.turn_block());
        text
    }

    /// Strings at which generation should stop (the closing tags of a complete turn; none in
    /// tool mode, where a reply ends with the end of its turn).
    pub fn stop_strings(&self) -> Vec<String> {
        if self.protocol.tools {
            return Vec::new();
        }
        match self.env.action_space() {
            ActionSpace::Named(_) | ActionSpace::FreeText => vec!["</answer>".to_string()],
            ActionSpace::SearchOrAnswer => vec!["</answer>".to_string(), "</search>".to_string()],
        }
    }

    /// Env actions still allowed in this episode, bounded by the turns left.
    pub fn actions_left(&self) -> usize {
        let turns_left = (self.protocol.max_turns + 1).saturating_sub(self.turn);
        let by_turns = turns_left.saturating_mul(self.protocol.max_actions_per_turn);
        self.env
            .max_steps()
            .saturating_sub(self.actions_used)
            .min(by_turns)
    }

    fn instruction(&self) -> String {
        let mut text = self.env.instruction();
        if let ActionSpace::Named(names) = self.env.action_space() {
            text.push_str(&format!("\nActions: {}.", names.join(", ")));
            if self.protocol.max_actions_per_turn > 1 {
                text.push_str(&format!(
                    " Up to {} actions per turn, separated by ||.",
                    self.protocol.max_actions_per_turn
                ));
            }
        }
        text
    }

    fn turn_block(&self) -> String {
        format!(
            "Turn {}:\nState:\n{}\nYou have {} actions left.\n",
            self.turn,
            self.turn_state.trim_matches('\n'),
            self.actions_left()
        )
    }

    /// Runs parsed actions until the budget or the episode ends; returns (reward, terminated,
    /// env truncated), or the first env error.
    fn execute(
        &mut self,
        actions: &[Action],
        info: &mut StepInfo,
        metrics: &mut Vec<(String, f32)>,
        observations: &mut Vec<String>,
    ) -> Result<(f32, bool, bool), EnvError> {
        let budget = self.env.max_steps().saturating_sub(self.actions_used);
        let mut reward = 0.0;
        let (mut terminated, mut truncated) = (false, false);
        info.action_is_valid = true;
        for action in actions.iter().take(budget) {
            let transition = self.env.step(action)?;
            observations.push(transition.observation.trim_matches('\n').to_string());
            self.actions_used += 1;
            info.num_actions += 1;
            reward += transition.reward;
            info.success = transition.info.success;
            info.action_is_valid &= transition.info.action_is_valid;
            info.action_is_effective |= transition.info.action_is_effective;
            terminated = transition.terminated;
            truncated = transition.truncated;
            *metrics = transition.info.metrics;
            if terminated || truncated {
                break;
            }
        }
        Ok((reward, terminated, truncated))
    }
}

/// Parses a response into the actions to execute; `None` when it is malformed or names an
/// unknown action.
pub(crate) fn parse_response(
    text: &str,
    space: &ActionSpace,
    enable_think: bool,
    max_actions: usize,
) -> Option<Vec<Action>> {
    let lower = text.to_ascii_lowercase();
    let body_start = if enable_think {
        let think = find_tag(text, &lower, "think", 0)?;
        think.end
    } else {
        0
    };
    match space {
        ActionSpace::Named(names) => {
            let answer = find_tag(text, &lower, "answer", body_start)?;
            if enable_think && !text[body_start..answer.start].trim().is_empty() {
                return None;
            }
            let actions: Vec<&str> = answer
                .inner
                .split("||")
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .take(max_actions)
                .collect();
            if actions.is_empty() {
                return None;
            }
            actions
                .iter()
                .map(|a| {
                    names
                        .iter()
                        .find(|n| n.eq_ignore_ascii_case(a))
                        .map(|n| Action::Move(n.clone()))
                })
                .collect()
        }
        ActionSpace::FreeText => {
            let answer = find_tag(text, &lower, "answer", body_start)?;
            if enable_think && !text[body_start..answer.start].trim().is_empty() {
                return None;
            }
            let inner = answer.inner.trim();
            (!inner.is_empty()).then(|| vec![Action::Answer(inner.to_string())])
        }
        ActionSpace::SearchOrAnswer => {
            let search = find_tag(text, &lower, "search", body_start);
            let answer = find_tag(text, &lower, "answer", body_start);
            let (block, is_search) = match (search, answer) {
                (Some(s), Some(a)) if s.start < a.start => (s, true),
                (_, Some(a)) => (a, false),
                (Some(s), None) => (s, true),
                (None, None) => return None,
            };
            if enable_think && !text[body_start..block.start].trim().is_empty() {
                return None;
            }
            let inner = block.inner.trim();
            if inner.is_empty() {
                return None;
            }
            let action = if is_search {
                Action::Search(inner.to_string())
            } else {
                Action::Answer(inner.to_string())
            };
            Some(vec![action])
        }
    }
}

/// A complete `<tag>inner</tag>` block found in a text.
struct TagBlock<'a> {
    /// Byte offset of `<tag>`.
    start: usize,
    /// Byte offset just after `</tag>`.
    end: usize,
    inner: &'a str,
}

/// First complete `<tag>…</tag>` at or after `from`, tags matched ASCII-case-insensitively.
/// `lower` is `text.to_ascii_lowercase()` (same byte offsets).
fn find_tag<'a>(text: &'a str, lower: &str, tag: &str, from: usize) -> Option<TagBlock<'a>> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let start = from + lower.get(from..)?.find(&open)?;
    let inner_start = start + open.len();
    let inner_end = inner_start + lower[inner_start..].find(&close)?;
    Some(TagBlock {
        start,
        end: inner_end + close.len(),
        inner: &text[inner_start..inner_end],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> ActionSpace {
        ActionSpace::Named(
            ["Left", "Down", "Right", "Up"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        )
    }

    fn moves(names: &[&str]) -> Option<Vec<Action>> {
        Some(names.iter().map(|n| Action::Move(n.to_string())).collect())
    }

    #[test]
    fn parses_answers_case_insensitively_and_splits_on_bars() {
        assert_eq!(
            parse_response("<answer>left</answer>", &grid(), false, 1),
            moves(&["Left"])
        );
        assert_eq!(
            parse_response("<ANSWER> UP </ANSWER>", &grid(), false, 1),
            moves(&["Up"])
        );
        assert_eq!(
            parse_response("<answer>Left || down||</answer>", &grid(), false, 5),
            moves(&["Left", "Down"])
        );
        assert_eq!(
            parse_response("<answer>Left || Down || Up</answer>", &grid(), false, 2),
            moves(&["Left", "Down"])
        );
    }

    #[test]
    fn malformed_text_is_invalid_and_never_panics() {
        for text in [
            "",
            "Left",
            "<answer>",
            "<answer>Jump</answer>",
            "<answer>Left || Jump</answer>",
            "<answer> || </answer>",
            "</answer><answer",
            "<answer>é</ANSWER>ü",
            "<think>x</think>",
        ] {
            assert_eq!(parse_response(text, &grid(), false, 3), None, "{text:?}");
            assert_eq!(parse_response(text, &grid(), true, 3), None, "{text:?}");
            let _ = parse_response(text, &ActionSpace::SearchOrAnswer, true, 1);
        }
    }

    #[test]
    fn think_is_required_only_when_enabled() {
        let text = "<think>go left</think> <answer>Left</answer>";
        assert_eq!(parse_response(text, &grid(), true, 1), moves(&["Left"]));
        assert_eq!(parse_response(text, &grid(), false, 1), moves(&["Left"]));
        assert_eq!(
            parse_response("<answer>Left</answer>", &grid(), true, 1),
            None
        );
        assert_eq!(
            parse_response(
                "<think>a</think>junk<answer>Left</answer>",
                &grid(),
                true,
                1
            ),
            None
        );
    }

    #[test]
    fn free_text_answers_are_taken_whole() {
        let free = ActionSpace::FreeText;
        assert_eq!(
            parse_response("<answer> search[red shoes] </answer>", &free, false, 3),
            Some(vec![Action::Answer("search[red shoes]".into())])
        );
        assert_eq!(parse_response("<answer> </answer>", &free, false, 1), None);
        assert_eq!(parse_response("search[red shoes]", &free, false, 1), None);
    }

    #[test]
    fn qa_takes_the_first_complete_block() {
        let qa = ActionSpace::SearchOrAnswer;
        assert_eq!(
            parse_response(
                "<search> Zorbex founder </search><answer>x</answer>",
                &qa,
                false,
                1
            ),
            Some(vec![Action::Search("Zorbex founder".into())])
        );
        assert_eq!(
            parse_response("<answer>Velmora</answer>", &qa, false, 1),
            Some(vec![Action::Answer("Velmora".into())])
        );
        assert_eq!(parse_response("<search></search>", &qa, false, 1), None);
    }

    #[test]
    fn step_info_json_without_the_gateway_flags_parses_with_both_false() {
        let old = r#"{"success": true, "action_is_valid": true, "action_is_effective": false,
            "format_penalty": 0.0, "num_actions": 1, "observation_text": "o", "action_text": "a"}"#;
        let info: StepInfo = serde_json::from_str(old).unwrap();
        assert!(info.success && !info.tool_call_error && !info.context_rebuilt);
        let flagged = StepInfo {
            tool_call_error: true,
            context_rebuilt: true,
            ..info
        };
        let json = serde_json::to_value(&flagged).unwrap();
        assert_eq!(json["tool_call_error"], true);
        assert_eq!(json["context_rebuilt"], true);
        assert_eq!(serde_json::from_value::<StepInfo>(json).unwrap(), flagged);
    }
}
