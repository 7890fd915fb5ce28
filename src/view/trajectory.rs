//! What the trajectory page shows, gathered from a snapshot: each step's texts, the new context
//! tokens decoded whole (what the model saw, template markers included), the tool calls of its
//! response, its response tokens decoded one id at a time (so their exact boundaries are
//! visible) with behaviour log-probs, value / advantage / return scored on the fly with a chosen
//! estimator, what the run's trainer used for the step (its credit log: the critic's value, the
//! advantage, the importance ratio, the behaviour version against the learner's), and the other
//! trajectories of the group as one line of moves and rewards each. Rendering is `pages`'.

use crate::algo::{self, AdvantageConfig, AdvantageInputs, ReplayRow};
use crate::store::{decode_trajectory, StepRecord, StoreError, Trajectory};
use crate::tokenizer::tool_calls::{ParsedCall, ParsedReply};
use crate::tokenizer::Tokenizer;
use crate::train::run::credit_log::StepCredit;

use super::index::{Snapshot, TrajSummary};

/// One response token.
#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    pub id: u32,
    /// The id decoded alone.
    pub text: String,
    /// Behaviour log-prob (0 for model-free agents).
    pub logprob: f32,
}

/// One step as the page shows it.
#[derive(Clone, Debug)]
pub struct StepDetail {
    pub record: StepRecord,
    /// The tokens new in the context at this step (`obs_ids`) decoded, chat-template markers
    /// included: the instruction, the question and tool results as the model saw them.
    pub observation: String,
    pub tokens: Vec<Token>,
    /// The tool calls the response made, read in the tokenizer's format (none when it made none
    /// or the template has no tool format); `Err` when it tried and the call did not parse.
    pub calls: Result<Vec<ParsedCall>, String>,
    /// The estimator's row for this step (none for an open trajectory or a failed scoring).
    pub scores: Option<ReplayRow>,
    /// What the run's trainer used for this step (none outside a run, or for a step no update
    /// has consumed yet).
    pub credit: Option<StepCredit>,
}

/// How the advantages were obtained.
#[derive(Clone, Debug, PartialEq)]
pub enum Scoring {
    /// Scored over the finished trajectories of the group; `zero_values` when the estimator
    /// reads a critic (none is run here).
    Scored { over: usize, zero_values: bool },
    /// The trajectory has no terminal step yet: its return is not final.
    Open,
    /// The estimator refused the records (the message says why).
    Failed(String),
}

/// Another trajectory of the same group, compactly.
#[derive(Clone, Debug)]
pub struct GroupMate {
    pub summary: TrajSummary,
    /// (short action, reward) per step.
    pub moves: Vec<(String, f32)>,
}

/// Everything the trajectory page needs.
#[derive(Clone, Debug)]
pub struct TrajectoryDetail {
    pub summary: TrajSummary,
    pub env: String,
    pub steps: Vec<StepDetail>,
    pub scoring: Scoring,
    pub group: Vec<GroupMate>,
}

/// Gathers trajectory `traj_id` of `snap`; `None` when there is no such trajectory.
pub fn gather(
    snap: &Snapshot,
    traj_id: u64,
    tokenizer: &Tokenizer,
    advantage: &AdvantageConfig,
) -> Result<Option<TrajectoryDetail>, StoreError> {
    let (Some(summary), Some(traj)) = (snap.index.get(traj_id), snap.dataset.trajectory(traj_id))
    else {
        return Ok(None);
    };
    let records = decode_trajectory(&traj)?;
    let mates: Vec<Trajectory<'_>> = snap
        .index
        .group(summary.group_id)
        .filter(|t| t.traj_id != traj_id)
        .filter_map(|t| snap.dataset.trajectory(t.traj_id))
        .collect();
    let (scoring, rows) = score(summary, &records, &mates, advantage)?;
    let steps = records
        .into_iter()
        .map(|record| {
            let scores = rows.iter().find(|r| r.step_index == record.step_index);
            let credit = snap.credit.get(&(record.traj_id, record.step_index));
            StepDetail {
                credit: credit.cloned(),
                observation: tokenizer.decode(&record.obs_ids),
                tokens: tokens(&record, tokenizer),
                calls: calls(&record.info.action_text, tokenizer),
                scores: scores.cloned(),
                record,
            }
        })
        .collect();
    let group = mates
        .iter()
        .filter_map(|m| Some((snap.index.get(m.traj_id)?, m)))
        .map(|(s, m)| mate(*s, m))
        .collect::<Result<_, _>>()?;
    Ok(Some(TrajectoryDetail {
        summary: *summary,
        env: snap.index.env_name(summary).to_string(),
        steps,
        scoring,
        group,
    }))
}

fn calls(response: &str, tokenizer: &Tokenizer) -> Result<Vec<ParsedCall>, String> {
    let Ok(format) = tokenizer.tool_call_format() else {
        return Ok(Vec::new());
    };
    match format.find_calls(response) {
        ParsedReply::Content => Ok(Vec::new()),
        ParsedReply::Calls { calls, .. } => Ok(calls),
        ParsedReply::Malformed { reason } => Err(reason),
    }
}

fn tokens(record: &StepRecord, tokenizer: &Tokenizer) -> Vec<Token> {
    let logprobs = record
        .response_logprobs
        .iter()
        .copied()
        .chain(std::iter::repeat(0.0));
    record
        .response_ids
        .iter()
        .zip(logprobs)
        .map(|(&id, logprob)| Token {
            id,
            text: tokenizer.decode(&[id]),
            logprob,
        })
        .collect()
}

/// Scores the trajectory together with the finished trajectories of its group (group-relative
/// estimators need them); returns this trajectory's rows.
fn score(
    summary: &TrajSummary,
    records: &[StepRecord],
    mates: &[Trajectory<'_>],
    advantage: &AdvantageConfig,
) -> Result<(Scoring, Vec<ReplayRow>), StoreError> {
    if summary.open {
        return Ok((Scoring::Open, Vec::new()));
    }
    let mut all = records.to_vec();
    let mut over = 1;
    for mate in mates {
        if !mate.is_open()? {
            all.extend(decode_trajectory(mate)?);
            over += 1;
        }
    }
    Ok(
        match algo::replay_rows(&all, &AdvantageInputs::default(), advantage) {
            Ok(export) => {
                let rows = export.rows.into_iter();
                let own = rows.filter(|r| r.traj_id == summary.traj_id).collect();
                let zero_values = export.zero_values;
                (Scoring::Scored { over, zero_values }, own)
            }
            Err(e) => (Scoring::Failed(e.to_string()), Vec::new()),
        },
    )
}

fn mate(summary: TrajSummary, traj: &Trajectory<'_>) -> Result<GroupMate, StoreError> {
    let mut moves = Vec::with_capacity(traj.steps.len());
    for step in &traj.steps {
        let meta = step.meta_view()?;
        moves.push((short_action(meta.action_text), meta.reward));
    }
    Ok(GroupMate { summary, moves })
}

/// What a response did, in a few characters: the `<answer>` body when there is one, else the
/// start of the text.
pub fn short_action(text: &str) -> String {
    const KEEP: usize = 40;
    let body = text
        .split_once("<answer>")
        .map(|(_, rest)| rest.split("</answer>").next().unwrap_or(rest))
        .unwrap_or(text)
        .trim();
    let mut out: String = body.chars().take(KEEP).collect();
    if body.chars().nth(KEEP).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::short_action;

    #[test]
    fn short_action_keeps_the_answer_body_and_cuts_long_texts() {
        assert_eq!(
            short_action("<think>hm</think><answer> Left </answer>"),
            "Left"
        );
        assert_eq!(short_action("Up"), "Up");
        let long = "x".repeat(100);
        assert_eq!(short_action(&long).chars().count(), 41);
    }
}
