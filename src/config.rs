//! The YAML run configuration: schema, defaults, `--set` overrides and validation.
//!
//! A config file is parsed to a `serde_json::Value` first, so that `--set a.b=c` can override any
//! key before the typed schema is read. Every struct denies unknown keys, and every error names
//! the file and the dotted key path it is about. Key names follow ROLL where the concept is the
//! same (`adv_estimator`, `rollout_batch_size`, `ppo_epochs`, `train_env_manager`, ...); the rest
//! (`context`, `critic`, `sft`, `cache`, ...) are stepppo's own. This module owns the schema and
//! its checks only; what the values do lives with the trainer, the estimators and the envs.

pub mod reference;

use crate::algo::config::{CriticTarget, KlConfig, KlEstimator, KlMode};
use crate::algo::config::{
    FilterType, GigpoConfig, Grouping, LossAggMode, NormMethod, RatioType, RewardNormalization,
    Schedule,
};
use crate::algo::{AdvantageConfig, Estimator, FilterConfig, LossConfig, OptimizerConfig};
use crate::kv::PrefillAttention;
use crate::model::Precision;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The ready config used by `stepppo train` when no `--config` is given.
pub const EMBEDDED_DEFAULT_YAML: &str = include_str!("../configs/frozenlake_steppo.yaml");
/// Name reported in errors about the embedded default.
pub const EMBEDDED_DEFAULT_NAME: &str = "<embedded configs/frozenlake_steppo.yaml>";

/// Errors while reading, overriding or validating a config; each names the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("{file}: cannot read: {source}")]
    Io {
        /// Path of the config file.
        file: String,
        /// The underlying read error.
        source: std::io::Error,
    },
    /// The file is not valid YAML.
    #[error("{file}: invalid YAML: {msg}")]
    Yaml {
        /// Path or name of the config file.
        file: String,
        /// The YAML parser's message.
        msg: String,
    },
    /// A key has a wrong type, is unknown, or fails validation.
    #[error("{file}: key `{key}`: {msg}")]
    Key {
        /// Path or name of the config file, followed by any `--set` overrides applied.
        file: String,
        /// Dotted path of the offending key (`<root>` for the top level).
        key: String,
        /// What is wrong with the key's value.
        msg: String,
    },
    /// A `--set` override is malformed or cannot be applied.
    #[error("--set {}: {msg}", shorten(arg))]
    Set {
        /// The override as given (`key.path=value`).
        arg: String,
        /// Why it was rejected.
        msg: String,
    },
    /// A resumed run's config changes keys outside [`RESUME_OVERRIDABLE`].
    #[error(
        "{file}: --resume continues the run's own config; these keys differ from it: {}. \
         Only {} may change on resume",
        keys.join(", "),
        RESUME_OVERRIDABLE.join(", ")
    )]
    ResumeMismatch {
        /// Path or name of the config given for the resume.
        file: String,
        /// Dotted paths of the keys that differ from the stored config.
        keys: Vec<String>,
    },
}

/// `arg` as shown in an error: at most 120 characters, the rest elided.
fn shorten(arg: &str) -> String {
    match arg.char_indices().nth(120) {
        Some((cut, _)) => format!("{}… ({} bytes)", &arg[..cut], arg.len()),
        None => arg.to_string(),
    }
}

/// Keys a resumed run may change: when it stops and how often it validates and saves, how many
/// threads compute, what the ranks partition, whether blocks are recomputed in the backward (memory for time) and the
/// dtype of the training products (the master weights are f32 either way) and of generation, where
/// the run directory is and where its gateway listens. Everything else is the run's own config,
/// kept in its checkpoints.
pub const RESUME_OVERRIDABLE: &[&str] = &[
    "max_steps",
    "eval_steps",
    "save_steps",
    "cpu_threads",
    "sharding",
    "activation_checkpointing",
    "precision",
    "rollout_dtype",
    "output_dir",
    "gateway.listen",
];

/// How the prompt of each step of a multi-turn trajectory is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContextLayout {
    /// Append-only: step t+1's context is step t's context + response + new observation, so one
    /// training forward covers a whole trajectory.
    Concat,
    /// Each step's prompt is re-rendered with the last `history_length` rounds (0: the current
    /// state only, for Markov envs).
    Window,
}

/// Where a fresh run's policy comes from ([`Config::pretrain_source`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PretrainSource<'a> {
    /// The built-in model of this size, initialised from the run seed.
    Builtin(BuiltinSize),
    /// A model of the shape an HF `config.json`-style file states, initialised from the run seed
    /// over the built-in tokenizer.
    Shape(&'a Path),
    /// An HF checkpoint or PEFT adapter directory, loaded.
    Checkpoint(&'a Path),
}

/// Size of the built-in model used when `pretrain: builtin`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinSize {
    /// 2 layers, hidden 32, 4 heads, 2 KV heads, MLP 64.
    Tiny,
    /// 4 layers, hidden 128, 4 heads, 2 KV heads, MLP 352, tied embeddings.
    Small,
}

/// Compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The CPU, on `cpu_threads` threads.
    Cpu,
    /// The CUDA device of this rank (`cuda:<local rank>`); needs a build with the `cuda` feature.
    Cuda,
}

/// The word a config file writes for `value`, an enum of the config (`state`, `step_gae`).
pub fn config_name<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value).expect("config enums serialise") {
        serde_json::Value::String(name) => name,
        other => other.to_string(),
    }
}

/// Critic architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CriticMode {
    /// A separate model of the policy's family with a value head (the StepPO scripts' critic):
    /// a copy of the policy as RL starts (after the warm start), unless `critic.pretrain` names
    /// a checkpoint directory or `builtin`.
    Separate,
    /// A linear value head on the policy's trunk; it trains in the actor's backward.
    Shared,
    /// A two-layer MLP (256 wide) on the policy's detached hidden states: the last four blocks'
    /// residual streams at the value position and the running means of the embeddings and of
    /// the last block's stream up to it, centred on the batch it was last fitted on and scaled
    /// by one factor to unit spread. Fitted after each update on the updated policy's features,
    /// so it costs one forward pass and sends no gradient into the policy.
    Features,
    /// An asymmetric critic: the same MLP on the env's numeric facts about the whole state at
    /// each step's start (`critic_state` in each record: FrozenLake's shortest path over ice,
    /// whether a path that always nears the goal exists, adjacent holes, budget left and what
    /// each move would do; Sokoban's solver optimum, solvability, distances, budget left and,
    /// for each move, whether it moves or pushes, lands a box on a target, leaves the room
    /// solvable or starts a shortest solution; search QA's gold paragraphs and answer found so
    /// far, which the policy never sees), which the agent's render does not state. Fitted
    /// after each update on the steps of the last `critic.history_batches` batches, in as many
    /// mini-batches as `ppo_epochs` passes over the newest batch take; it costs no forward
    /// pass. Every training env must supply such facts (FrozenLake, Sokoban and search QA do),
    /// and a `gateway` run cannot use it (its outside agents send no env state).
    State,
    /// No critic: for the critic-free estimators.
    None,
}

/// `critic`: the value model. `adv_estimator` `step_gae` and `token_gae` need a critic, and a
/// fresh run with any other estimator refuses one (it would never be read). A setting the
/// chosen critic cannot use (`pretrain` without `separate`, `sft.value_loss_coef` with a critic
/// made after the warm start, `history_batches` above 1 without `state`) is an error. With
/// constrained decoding the step-start value is read at the first free choice, past the forced
/// `<answer>` tag.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CriticConfig {
    /// Which critic.
    pub mode: CriticMode,
    /// Where a `separate` critic starts: `builtin` (a fresh built-in trunk) or an HF checkpoint
    /// directory. Unset: a copy of the policy as RL starts (after the warm start), with a fresh
    /// value head. An error with any other `mode`.
    pub pretrain: Option<String>,
    /// LoRA adapters on a `separate` critic's projections (same keys as the policy's `lora`):
    /// only they and the value head train; the critic's base is frozen and, when the critic is
    /// a copy of a LoRA policy, shares the policy's base weights instead of copying them. An
    /// error with any other `mode`.
    pub lora: Option<crate::model::LoraSpec>,
    /// Learning rate of the critic's AdamW optimizer (> 0), which follows the actor's schedule,
    /// warm-up and gradient clip.
    pub learning_rate: f64,
    /// Weight decay of the critic's AdamW optimizer.
    pub weight_decay: f64,
    /// Value clip range (verl `cliprange_value`), > 0; unset: no clipping.
    pub value_clip: Option<f32>,
    /// Whether groups dropped by the rollout filter (`rollout_filter_ratio`) still train the
    /// critic.
    pub train_on_filtered: bool,
    /// The first this many RL steps train the critic only, the policy frozen (verl's
    /// `critic_warmup`): the critic is fitted to Monte-Carlo step returns of the warm-started
    /// policy before its advantages steer the policy. 0 = off. Needs a critic.
    pub warmup_steps: usize,
    /// Passes of the critic over each batch (at least 1); unset: the actor's `ppo_epochs`. More
    /// passes than the actor's fit the critic faster than the policy moves; a `shared` head
    /// needs at least the actor's (it trains in the actor's backward).
    pub ppo_epochs: Option<usize>,
    /// A state critic (`mode: state`) is fitted on the step rows of the last this many rollout
    /// batches, the newest included; each fit makes `ppo_epochs` passes' worth of mini-batches
    /// of the newest batch, drawn from all of them. 1 = the newest batch alone; above 1 is an
    /// error with `separate`, `shared` or `features`. The history is saved in each checkpoint
    /// (`ckpt-N/critic_history.safetensors`).
    pub history_batches: usize,
}

impl CriticConfig {
    /// Passes of the critic over each batch.
    pub fn epochs(&self, actor_epochs: usize) -> usize {
        self.ppo_epochs.unwrap_or(actor_epochs)
    }
}

impl Default for CriticConfig {
    fn default() -> Self {
        CriticConfig {
            mode: CriticMode::None,
            pretrain: None,
            lora: None,
            learning_rate: 1e-4,
            weight_decay: 0.0,
            value_clip: None,
            train_on_filtered: true,
            warmup_steps: 0,
            ppo_epochs: None,
            history_batches: 1,
        }
    }
}

/// `generating_args` (rollouts) and `val_generating_args` (validation): how responses are
/// decoded, with HF's names. Validation decodes greedily by default (`do_sample: false`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct GeneratingArgs {
    /// Most tokens generated per response (one turn); at least 1.
    pub max_new_tokens: usize,
    /// Sampling temperature; > 0 when sampling.
    pub temperature: f32,
    /// Nucleus sampling: sample among the most likely tokens whose probabilities sum to this;
    /// in (0, 1], 1 = off.
    pub top_p: f32,
    /// Sample among the k most likely tokens; 0 disables top-k.
    pub top_k: usize,
    /// Sample (`true`) or decode greedily (`false`).
    pub do_sample: bool,
}

impl Default for GeneratingArgs {
    fn default() -> Self {
        GeneratingArgs {
            max_new_tokens: 32,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            do_sample: true,
        }
    }
}

/// `train_env_manager` (the rollout batch of each step) and `val_env_manager` (the validation
/// episodes), ROLL's names: which envs are played, in groups of trajectories that share an env
/// seed (the same map or question), so group baselines compare answers to the same task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EnvManagerConfig {
    /// Groups per batch, each on an env seed of its own: the sum of `num_groups_partition`, at
    /// least 1. Optional: computed when absent (and written into the run's config), an error
    /// naming it when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_env_groups: Option<usize>,
    /// Trajectories per group (G), all on the group's env seed; at least 1 (`rloo` needs 2).
    pub group_size: usize,
    /// Env tags (keys of `custom_envs`), one per partition; at least one.
    pub tags: Vec<String>,
    /// Number of groups of each tag, in `tags` order; their sum is the batch's groups.
    pub num_groups_partition: Vec<usize>,
    /// Training only (an error under `val_env_manager`): draw env seeds from this many levels
    /// (group `g` plays level `g mod n`), as Procgen's `num_levels`, so each level is seen again
    /// every `n / groups` steps and a critic can learn its value, while validation keeps
    /// playing levels training never saw. At least 1; unset: a new level for every group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_levels: Option<u64>,
}

impl EnvManagerConfig {
    /// Groups per batch: the sum of `num_groups_partition` (`num_env_groups` restates it).
    pub fn groups(&self) -> usize {
        self.num_groups_partition.iter().sum()
    }

    /// Trajectories per rollout batch.
    pub fn batch_size(&self) -> usize {
        self.groups() * self.group_size
    }

    /// The tag of each group, in group order.
    pub fn group_tags(&self) -> Vec<&str> {
        self.tags
            .iter()
            .zip(&self.num_groups_partition)
            .flat_map(|(tag, &n)| std::iter::repeat_n(tag.as_str(), n))
            .collect()
    }
}

/// `custom_envs.<tag>`: one env of the run under a tag of your choice, which `tags` lists
/// (`train_env_manager`, `val_env_manager`, `sft`) name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CustomEnv {
    /// Which env.
    #[schemars(schema_with = "crate::env::env_type_schema")]
    pub env_type: String,
    /// The env's settings over its defaults: the protocol keys every env takes and the env's
    /// own keys (see the env sections below); an unknown key is an error naming the env and the
    /// key.
    #[serde(default = "empty_object")]
    #[schemars(with = "serde_json::Map<String, serde_json::Value>")]
    pub env_config: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// `sft`: the supervised warm start run before RL: behaviour cloning of a model-free agent's
/// transcripts (after the optional copy pre-training of `sft.copy`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Gradient steps of the cloning; 0 disables it.
    pub steps: usize,
    /// Episodes of the agent collected as training data; at least 1 when `steps` > 0.
    pub episodes: usize,
    /// The agent whose transcripts are cloned.
    #[schemars(with = "crate::env::AgentKind")]
    pub agent: String,
    /// Env tags (keys of `custom_envs`) whose episodes the agent plays, taken in turn; empty
    /// (the default): the training envs, as `train_env_manager` groups them. A tag of its own
    /// lets the warm start teach part of the task (e.g. a `hotpotqa` env with
    /// `question_type: bridge`) and leave the rest to RL.
    pub tags: Vec<String>,
    /// Trajectories per gradient step; at least 1 when `steps` > 0.
    pub batch_size: usize,
    /// AdamW learning rate of the cloning and of `sft.copy`; > 0.
    pub learning_rate: f64,
    /// Critic warm-up: weight of the value regression of the critic's step-start values on the
    /// transcripts' discounted returns (γ = `gamma`), trained alongside the cloning; 0 leaves
    /// the critic untrained. Needs `adv_estimator: step_gae` and a critic that exists during
    /// the warm start: `shared`, or `separate` with `critic.pretrain` set (a `features` or
    /// `state` critic is fitted during RL only: warm it up with `critic.warmup_steps`).
    pub value_loss_coef: f64,
    /// Weight of the cross-entropy on the environment's tokens (the observations the transcripts
    /// received: the model learns to read and predict the env's text, not which action is better);
    /// 0 trains on the responses only.
    pub observation_loss_coef: f64,
    /// Copy pre-training before the cloning.
    pub copy: CopyPretrainConfig,
}

/// `sft.copy`: copy pre-training before the cloning, at `sft.learning_rate`: next-token
/// prediction on sequences of random ordinary tokens in which spans of 2–8 earlier tokens recur,
/// the loss on the recurring tokens. It teaches copying from the context, which search QA's
/// every action needs, and no env fact; the held-out copy probability is reported. Off unless
/// `steps` > 0, and then it needs `batch_size` ≥ 1 and `length` ≥ 4.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CopyPretrainConfig {
    /// Gradient steps; 0 skips the copy pre-training.
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub length: usize,
    /// When set, in (0, 1]: training goes on past `steps`, in rounds of 500 steps, until the
    /// held-out copy probability reaches this value or `max_steps` steps have run (the copying
    /// circuit forms abruptly, at a step that varies with the seed); each check is printed, and
    /// a warning when `max_steps` ends it below the target.
    pub until_probability: Option<f64>,
    /// The most steps `until_probability` may run to: above `steps`, and only with
    /// `until_probability` set.
    pub max_steps: usize,
}

impl Default for CopyPretrainConfig {
    fn default() -> Self {
        CopyPretrainConfig {
            steps: 0,
            batch_size: 16,
            length: 64,
            until_probability: None,
            max_steps: 0,
        }
    }
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            steps: 0,
            episodes: 256,
            agent: "random".into(),
            tags: Vec::new(),
            batch_size: 16,
            learning_rate: 1e-3,
            value_loss_coef: 0.0,
            observation_loss_coef: 0.0,
            copy: CopyPretrainConfig::default(),
        }
    }
}

/// `self_imitation`: replay of the better choices of a group. After each rollout, in the
/// `window` layout, where the steps of one group visited the same state with different
/// responses and one response's mean discounted return (γ = `step_reward_gamma`) beat every
/// other's by at least `margin`, that step enters a buffer, a newer verdict on the state
/// replacing the older. In the `concat` layout (where a step's prompt is the whole history) the
/// choice is the whole trajectory: among a group's distinct trajectories, one whose return
/// beats every other's by at least `margin` enters the buffer whole, a newer verdict on the same
/// first prompt replacing the older. Every actor mini-batch adds `coef ×` the mean negative
/// log-likelihood of the responses of `batch_size` buffer entries. The buffer is saved in each
/// checkpoint (`ckpt-N/self_imitation/`, a step dataset). Logged as
/// `self_imitation/{added,buffer_size,nll}` (`buffer_size` counts entries).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SelfImitationConfig {
    /// Weight of the replayed entries' mean negative log-likelihood in the actor loss (≥ 0);
    /// 0 = off.
    pub coef: f64,
    /// Entries the buffer holds (steps, or trajectories in the concat layout), at most one per
    /// state (or first prompt); the oldest leave first. At least 1 when `coef` > 0.
    pub buffer_size: usize,
    /// Buffer entries replayed with every actor mini-batch; at least 1 when `coef` > 0.
    pub batch_size: usize,
    /// How far (≥ 0) the better choice's mean discounted return (γ = `step_reward_gamma`) must
    /// lie above every other choice's in the same place for it to enter the buffer.
    pub margin: f64,
}

impl Default for SelfImitationConfig {
    fn default() -> Self {
        SelfImitationConfig {
            coef: 0.0,
            buffer_size: 1024,
            batch_size: 8,
            margin: 0.05,
        }
    }
}

/// `async_rollout`: generation in a thread of its own, with an engine of its own, running ahead
/// of the trainer (ROLL's `async_generation_ratio`, AReaL's bounded staleness). With
/// `staleness: k > 0` the batch the trainer consumes at step s was generated by policy version
/// max(s − k, 0), whatever the timing: the rollout thread generates the next k batches while
/// the trainer updates, is never more than k versions behind, and takes each new version's
/// weights (a copy) at a step boundary without stopping the trainer, flushing its cache so that
/// no K/V of one version is served to another. The schedule is fixed, so a run is as
/// deterministic as a synchronous one. Every record carries its `policy_version`. The update
/// corrects for the lag with decoupled PPO (AReaL): the clipped ratio is taken against the
/// policy as the update starts (one extra forward pass over the batch, `time/proximal`), and
/// each token's loss is weighted by π_prox / π_behav (from the stored behaviour log-probs),
/// truncated at `behaviour_weight_cap`. Logged: `rollout/staleness_mean|max`,
/// `time/trainer_wait` and `time/rollout_wait` (each side waiting for the other),
/// `async/rollout_busy` and `async/trainer_busy` (busy shares of the wall time so far),
/// `actor/behaviour_weight_mean|max|truncated`. A checkpoint waits for the batches generated
/// ahead of it and keeps them (`ckpt-N/pending_rollouts/`), so `--resume` continues exactly.
/// Refused with a `gateway` or on several ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AsyncRolloutConfig {
    /// Policy versions by which generation runs ahead of the trainer; 0 = synchronous.
    pub staleness: usize,
    /// The policy the clipped ratio is taken against.
    pub proximal: ProximalPolicy,
    /// Upper bound of the per-token weight π_prox / π_behav; a finite number ≥ 1.
    pub behaviour_weight_cap: f64,
}

impl Default for AsyncRolloutConfig {
    fn default() -> Self {
        AsyncRolloutConfig {
            staleness: 0,
            proximal: ProximalPolicy::Recompute,
            behaviour_weight_cap: 2.0,
        }
    }
}

/// `async_rollout.proximal`: the anchor of the clipped ratio on responses whose stored log-probs
/// are not the update's own: those of older versions, and every response when the rollout and
/// the update compute in different numerics (bf16 in `precision` or `rollout_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProximalPolicy {
    /// Decoupled PPO: the policy as the update starts, recomputed in the update's numerics,
    /// with truncated behaviour weights (which also correct the sampler's rounding).
    Recompute,
    /// The behaviour policy's stored log-probs: no extra pass and no correction of the lag
    /// (off-policy PPO without a correction, as one-step-off-policy pipelines run it).
    Behaviour,
}

impl AsyncRolloutConfig {
    /// Whether generation runs in its own thread.
    pub fn is_async(&self) -> bool {
        self.staleness > 0
    }
}

/// `cache`: the rollout engine's KV cache.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Reuse shared prefixes through the radix prefix cache; `false`: every sequence is
    /// prefilled from scratch.
    pub prefix_cache: bool,
    /// KV slots in the pool (tokens across all live sequences and cached prefixes); at least 1.
    pub kv_slots: usize,
    /// The kernel of prefill attention on CUDA (calls where a sequence brings more than one new
    /// token; decode always runs our split-context kernel). `flash` also needs `device: cuda`
    /// and bf16 generation (`rollout_dtype` unset or `bf16`). `scripts/gpu_check.sh` measures
    /// the two side by side.
    pub prefill_attention: PrefillAttention,
    /// Cascade attention on the CPU: context slots that several running sequences share (a
    /// group's prompt, an earlier turn held once in the radix cache) are read once per forward
    /// for all of them and merged per token by log-sum-exp; `false`: each token reads its whole
    /// context alone. Agrees with the per-token kernel to f32 rounding.
    pub cascade_attention: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            prefix_cache: true,
            kv_slots: 65536,
            prefill_attention: PrefillAttention::Paged,
            cascade_attention: true,
        }
    }
}

/// `gateway`: train from agents outside the process. With this section, `stepppo train` serves
/// the OpenAI-compatible gateway instead of running its own agent loop: clients play episodes
/// against it, close each session with its reward, and `train_env_manager`'s groups,
/// each `group_size` closed sessions of one task, make a rollout batch (the gateway serves
/// the new weights from the next request on). Validation still runs `val_env_manager`. A
/// `state` critic and `async_rollout` are refused with a gateway. `docs/gateway.md` has the
/// protocol.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// `host:port` to listen on (port 0 picks a free one, printed at start). May change on
    /// `--resume`. An address other than loopback needs an API key in the `STEPPPO_API_KEY`
    /// environment variable (never in the config, so never in the run directory); with the
    /// variable set, every request must send it as `Authorization: Bearer <key>`.
    pub listen: String,
    /// The model id clients send.
    pub served_model_name: String,
    /// Reply length in tokens when a request gives no `max_tokens`; at least 1.
    pub default_max_tokens: usize,
    /// Seconds an idle session is kept open before it is dropped unrecorded; at least 1.
    pub session_ttl_s: u64,
    /// Largest request body in bytes; at least 1024.
    pub max_body_bytes: usize,
    /// Added to the reward of a step whose reply tried to call a tool and the call did not
    /// parse (the reply is returned as text; the step records `tool_call_error`); ≤ 0.
    pub tool_call_penalty: f32,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: "127.0.0.1:8000".into(),
            served_model_name: "stepppo".into(),
            default_max_tokens: 64,
            session_ttl_s: 600,
            max_body_bytes: 1 << 20,
            tool_call_penalty: -0.1,
        }
    }
}

impl GatewayConfig {
    fn validate(&self) -> Result<(), (String, String)> {
        let port = self.listen.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
        if !matches!(port, Some(Ok(_))) {
            return Err((
                "gateway.listen".into(),
                format!("expected host:port, got `{}`", self.listen),
            ));
        }
        check_positive("gateway.default_max_tokens", self.default_max_tokens as f64)?;
        check_positive("gateway.session_ttl_s", self.session_ttl_s as f64)?;
        if self.max_body_bytes < 1024 {
            return Err((
                "gateway.max_body_bytes".into(),
                format!("must be at least 1024, got {}", self.max_body_bytes),
            ));
        }
        if !(self.tool_call_penalty <= 0.0 && self.tool_call_penalty.is_finite()) {
            return Err((
                "gateway.tool_call_penalty".into(),
                format!("must be finite and ≤ 0, got {}", self.tool_call_penalty),
            ));
        }
        Ok(())
    }
}

/// A whole run configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Run name: the run directory is `runs/<exp_name>` unless `output_dir` says otherwise.
    pub exp_name: String,
    /// Base seed of every RNG of the run.
    #[serde(default)]
    pub seed: u64,
    /// Run directory; unset: `runs/<exp_name>`. May change on `--resume`.
    #[serde(default)]
    pub output_dir: Option<String>,

    // --- schedule
    /// Training steps (policy versions); at least 1. May change on `--resume`.
    pub max_steps: usize,
    /// Validate every this many steps (and at the end); 0 = only at the end. May change on
    /// `--resume`.
    #[serde(default)]
    pub eval_steps: usize,
    /// Checkpoint every this many steps (and at the end); 0 = only at the end. May change on
    /// `--resume`.
    #[serde(default)]
    pub save_steps: usize,
    /// Trajectories per step: `train_env_manager`'s groups × `group_size`. Optional: computed
    /// when absent (and written into the run's config), an error naming it when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_batch_size: Option<usize>,
    /// Validation episodes: `val_env_manager`'s groups × `group_size`. Optional as
    /// `rollout_batch_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_batch_size: Option<usize>,

    // --- model
    /// The policy: `builtin` (the built-in model of `builtin_size`), an HF checkpoint directory
    /// (dense Qwen2/2.5, Qwen3, Llama 3), or an HF `config.json`-style file (a path ending in
    /// `.json`, e.g. `configs/models/qwen2.5-0.5b.json`): a model of that shape initialised from
    /// the run seed over the built-in tokenizer, as `builtin` is (its `vocab_size` must hold the
    /// tokenizer's ids; sizing and speed runs at real shapes without weights to download).
    #[serde(default = "builtin")]
    pub pretrain: String,
    /// Size of the built-in model (`pretrain: builtin`).
    #[serde(default = "small")]
    pub builtin_size: BuiltinSize,
    /// LoRA adapters on the policy's projections: only they (and a shared value head) are
    /// trained, the base weights (the policy after any warm start) frozen and outside the
    /// optimizer; the reference policy of a KL term is the base; checkpoints hold the adapters
    /// in PEFT's layout. Unset: full fine-tuning.
    #[serde(default)]
    pub lora: Option<crate::model::LoraSpec>,
    /// A PEFT LoRA adapter directory to start the policy's adapters from (its rank, alpha and
    /// target modules must equal `lora`'s when that is set; unset, they become `lora`).
    #[serde(default)]
    pub pretrain_adapter: Option<String>,
    /// Where the model computes.
    #[serde(default = "cpu")]
    pub device: DeviceKind,
    /// CPU compute threads (candle/rayon); 0 = one per core. On a small shared machine 1 thread
    /// measured 3× faster than 2 for this workload (small matrices, oversubscribed cores). May
    /// change on `--resume`.
    #[serde(default)]
    pub cpu_threads: usize,
    /// What the data-parallel ranks partition instead of replicating (ZeRO-1/2/3): the AdamW
    /// moments, also the summed gradients, also the weights. Any rank count and mode reads a
    /// checkpoint back (a sharded one holds each rank's block of the optimizer state), so it may
    /// change on `--resume`. A mode other than `none` is refused in a process started without a
    /// launcher (`mpirun -np 1` runs it, with one block). `docs/guides/data-parallel.md` says
    /// which to pick from `stepppo plan --ranks N --sharding MODE`.
    #[serde(default)]
    pub sharding: crate::dist::shard::Sharding,
    /// The value model.
    #[serde(default)]
    pub critic: CriticConfig,
    /// Prompt layout of multi-turn trajectories; it also decides what `ppo_mini_batch_size`
    /// counts.
    #[serde(default = "concat")]
    pub context: ContextLayout,
    /// Forward every training-path pass as a prefix tree: the update's mini-batches, the
    /// rollout-time critic values and reference log-probs, the feature-critic fit, the
    /// self-imitation replay and the warm start (`sft`). The sequences of one group (same env
    /// seed) share the longest common prefix of their tokens (at least the first prompt; more
    /// when every branch sampled the same first responses), which is forwarded and
    /// back-propagated once, its K/V read by every branch; the tokens are packed without
    /// padding. Losses, gradients and critic values equal the padded per-sequence forward's to
    /// f32 rounding (a scored token inside the shared prefix still counts once per branch), in
    /// both layouts (in `window` the steps of a group share at least the system prompt; in the
    /// warm start the transcripts of one group share their prompt). On CUDA the tree's attention
    /// is a matmul per segment (not yet measured on a GPU). On by default: faster on the
    /// embedded default and on the HotpotQA config (BENCHMARKS.md, "Group-tree training
    /// forward"); `false`: the padded per-sequence forward.
    #[serde(default = "tree_forward")]
    pub tree_forward: bool,
    /// Recompute each decoder block's activations in the backward instead of keeping them from
    /// the forward (policy and separate critic, warm start included): an update keeps one
    /// block's activations at a time plus two hidden-size vectors a layer and token, for about
    /// one more forward of time; the gradients are the same. On the CPU and CUDA.
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// The dtype of the training path's matrix products (policy, separate critic and KL
    /// reference, warm start included): `f32`, or `bf16` mixed precision — every projection, MLP,
    /// adapter and LM-head product reads bf16 copies of the weights and writes bf16, while the
    /// master weights, gradients and AdamW moments, the residual stream, norms, RoPE, attention,
    /// log-probs, entropies, values and losses stay f32 (PyTorch autocast's split). Generation
    /// has its own key, `rollout_dtype`.
    #[serde(default)]
    pub precision: Precision,
    /// The dtype generation stores the policy's weights, activations and K/V in: `f32`, or
    /// `bf16` as a transformers model loaded in bf16 computes (norms, attention scores and
    /// softmax, log-probs and sampling accumulate in f32). Unset: f32 on the CPU, bf16 on CUDA.
    /// The update scores the sampled tokens in `precision`; when either is bf16 the update
    /// recomputes the sampled tokens' log-probs in its own numerics and weights each token by
    /// the truncated ratio to the sampler's (`async_rollout.proximal: recompute`, the default);
    /// the reward's KL penalty then reads these recomputed log-probs too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_dtype: Option<Precision>,
    /// Rounds kept in the re-rendered prompt of the `window` layout; 0 holds the current state
    /// only.
    #[serde(default = "two")]
    pub history_length: usize,
    /// Every response follows the env's answer grammar: `<answer>` + one of the action names
    /// (up to `max_actions_per_turn`, joined by `||`) + `</answer>`, after free
    /// `<think>…</think>` text when the protocol asks for it. The tags are forced (log-prob 0,
    /// no gradient) and the model only chooses the actions. The rollout samples, and the update
    /// scores every response token, over the allowed tokens only, so a negative advantage moves
    /// probability to the other actions and never out of the format. Needs envs with named
    /// actions (not `hotpotqa`), or a `remote` env whose answers offer each state's
    /// `admissible_actions`: the response then names one of those, and the step keeps the list
    /// so that the update scores it under the same grammar.
    #[serde(default)]
    pub constrained_decoding: bool,
    /// The rollout engine's KV cache.
    #[serde(default)]
    pub cache: CacheConfig,
    /// Train from outside agents through the OpenAI-compatible gateway; unset: the run plays
    /// its own envs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewayConfig>,
    /// The supervised warm start before RL.
    #[serde(default)]
    pub sft: SftConfig,
    /// Replay of the better choices of a group.
    #[serde(default)]
    pub self_imitation: SelfImitationConfig,
    /// Generation running ahead of the trainer.
    #[serde(default)]
    pub async_rollout: AsyncRolloutConfig,
    /// Decoding of the training rollouts.
    #[serde(default)]
    pub generating_args: GeneratingArgs,
    /// Decoding of the validation episodes (greedy by default).
    #[serde(default = "greedy")]
    pub val_generating_args: GeneratingArgs,

    // --- credit assignment (ROLL names; see `algo::AdvantageConfig`)
    /// How rewards (and values) become advantages.
    pub adv_estimator: Estimator,
    /// Discount γ, in [0, 1]: across steps (`step_gae`), across tokens (`token_gae`,
    /// `reinforce_plus_plus`), or across steps for the returns of the trajectory-score
    /// estimators.
    #[serde(default = "one_f32")]
    pub gamma: f32,
    /// GAE λ (ROLL spelling), in [0, 1].
    #[serde(default = "one_f32")]
    pub lambd: f32,
    /// How the critic-free estimators normalise scores and returns within groups.
    #[serde(default)]
    pub reward_normalization: RewardNormalization,
    /// Whiten the advantages over the batch; unset: the estimator's own default (on for
    /// `step_gae`, per step row, and for `token_gae`, `reinforce_plus_plus` and
    /// `reinforce_plus_plus_baseline`, per token; off for the others).
    #[serde(default)]
    pub whiten_advantages: Option<bool>,
    /// Clamp advantages to ±c after whitening (c > 0); unset: no clamp.
    #[serde(default)]
    pub advantage_clip: Option<f32>,
    /// Cap at 0 the advantage of every step whose response did not parse (`action_is_valid`
    /// false): such a step left the env where it was, so it earns no credit for what the
    /// trajectory did next; without the cap a malformed answer in a successful trajectory is
    /// reinforced, rare tokens and all. Logged as `advantage/invalid_clamped_frac`.
    #[serde(default)]
    pub clamp_invalid_advantages: bool,
    /// Clamp rewards to ±c (c > 0): after normalisation for the trajectory-score estimators, the
    /// raw step rewards for the GAE and REINFORCE++ ones; unset: no clamp.
    #[serde(default)]
    pub reward_clip: Option<f32>,
    /// γ of the discounted step returns of `gigpo` and `step_reinforce` (and of
    /// `self_imitation`'s verdicts), in [0, 1].
    #[serde(default = "step_reward_gamma")]
    pub step_reward_gamma: f32,
    /// GiGPO's settings (`adv_estimator: gigpo`).
    #[serde(default)]
    pub gigpo: GigpoConfig,
    /// StarPO-S: fraction of groups kept, ranked by in-group reward std (`rollout_filter_type`),
    /// in (0, 1]; 1.0 keeps all.
    #[serde(default = "one_f32")]
    pub rollout_filter_ratio: f32,
    /// StarPO-S: which groups `rollout_filter_ratio` keeps.
    #[serde(default = "std_filter")]
    pub rollout_filter_type: FilterType,

    // --- policy update
    /// Passes over each batch; at least 1.
    #[serde(default = "one_usize")]
    pub ppo_epochs: usize,
    /// Sequences per mini-batch: trajectories in the `concat` layout, step rows in `window`;
    /// in 1..=`rollout_batch_size`.
    pub ppo_mini_batch_size: usize,
    /// The actor's AdamW learning rate; > 0.
    pub learning_rate: f64,
    /// The actor's AdamW weight decay.
    #[serde(default)]
    pub weight_decay: f64,
    /// Linear learning-rate warm-up, in optimizer steps.
    #[serde(default)]
    pub warmup_steps: usize,
    /// Learning-rate schedule after the warm-up.
    #[serde(default)]
    pub lr_schedule: Schedule,
    /// PPO clip range below 1 (ε_low): the ratio is clipped at 1 − ε_low; > 0.
    #[serde(default = "clip_02")]
    pub pg_clip_low: f32,
    /// PPO clip range above 1 (ε_high): the ratio is clipped at 1 + ε_high; > 0 (StarPO-S and
    /// DAPO's clip-higher: 0.28).
    #[serde(default = "clip_02")]
    pub pg_clip_high: f32,
    /// Dual-clip PPO: the loss of a negative-advantage token is also bounded by c · |A|, with
    /// c = 1 + 2 · `pg_clip_low` (ROLL's bound).
    #[serde(default)]
    pub dual_clip_loss: bool,
    /// What the importance ratio is taken over.
    #[serde(default = "token_ratio")]
    pub ratio_type: RatioType,
    /// How token losses become one scalar (verl/ROLL `loss_agg_mode`), for the actor and the
    /// critic. A row is a sequence of the mini-batch: a trajectory in the `concat` layout, a
    /// step in `window`.
    #[serde(default = "seq_mean_token_mean")]
    pub loss_agg_mode: LossAggMode,
    /// KL-in-reward: each response token's reward is charged `init_kl_coef · KL` against the
    /// reference policy (the policy as training starts, after any warm start, saved to
    /// `<run>/reference/`), with the estimator `kl_penalty`. A finite number ≥ 0; 0 = off, and
    /// no reference model is kept unless `use_kl_loss` is on.
    #[serde(default)]
    pub init_kl_coef: f32,
    /// KL estimator of the penalty and of the KL loss (ROLL `kl_penalty`).
    #[serde(default = "k1")]
    pub kl_penalty: KlEstimator,
    /// KL loss against the reference policy (ROLL/verl `use_kl_loss`): the actor loss gains
    /// `kl_loss_coef · agg(KL(π ‖ π_ref))` over the response tokens, with the estimator
    /// `kl_penalty`. Logged as `actor/kl_loss`.
    #[serde(default)]
    pub use_kl_loss: bool,
    /// Weight of the KL loss; a finite number ≥ 0, and > 0 when `use_kl_loss` is on.
    #[serde(default)]
    pub kl_loss_coef: f32,
    /// Weight of the entropy bonus in the actor loss.
    #[serde(default)]
    pub entropy_loss_coef: f32,
    /// λ of an unlikelihood term on the sampled tokens with a negative advantage: the actor loss
    /// gains `λ · agg(|A| · −log(1 − π))`, whose push stays strong where the policy is sure of
    /// a bad choice (the clipped surrogate's gradient there fades with 1 − π); forced tokens
    /// are skipped. Logged as `actor/unlikelihood_loss`. A finite number ≥ 0; 0 = off.
    #[serde(default)]
    pub negative_unlikelihood_coef: f32,
    /// Global gradient-norm clip; > 0.
    #[serde(default = "one_f32")]
    pub max_grad_norm: f32,

    // --- environments
    /// The training rollouts: which envs each step's batch plays, in groups.
    pub train_env_manager: EnvManagerConfig,
    /// The validation episodes: which envs validation plays, in groups.
    pub val_env_manager: EnvManagerConfig,
    /// The run's envs, by tag.
    pub custom_envs: BTreeMap<String, CustomEnv>,
}

fn builtin() -> String {
    "builtin".into()
}
fn small() -> BuiltinSize {
    BuiltinSize::Small
}
fn cpu() -> DeviceKind {
    DeviceKind::Cpu
}
fn concat() -> ContextLayout {
    ContextLayout::Concat
}
fn tree_forward() -> bool {
    true
}
fn two() -> usize {
    2
}
fn k1() -> KlEstimator {
    KlEstimator::K1
}
fn one_usize() -> usize {
    1
}
fn one_f32() -> f32 {
    1.0
}
fn clip_02() -> f32 {
    0.2
}
fn step_reward_gamma() -> f32 {
    0.95
}
fn std_filter() -> FilterType {
    FilterType::Std
}
fn token_ratio() -> RatioType {
    RatioType::Token
}
fn seq_mean_token_mean() -> LossAggMode {
    LossAggMode::SeqMeanTokenMean
}
fn greedy() -> GeneratingArgs {
    GeneratingArgs {
        do_sample: false,
        ..GeneratingArgs::default()
    }
}

impl Config {
    /// The words the config's envs write ([`crate::env::builtin_words`]), sorted and without
    /// repeats: what the built-in tokenizer of a run on this config adds as whole-word tokens.
    pub fn builtin_words(&self) -> Result<Vec<String>, String> {
        let mut words = std::collections::BTreeSet::new();
        for (tag, spec) in &self.custom_envs {
            let found = crate::env::builtin_words(&spec.env_type, &spec.env_config)
                .map_err(|e| format!("custom_envs.{tag}: {e}"))?;
            words.extend(found);
        }
        Ok(words.into_iter().collect())
    }

    /// The embedded default (`configs/frozenlake_steppo.yaml`).
    pub fn embedded_default() -> Config {
        Config::from_yaml_str(EMBEDDED_DEFAULT_YAML, EMBEDDED_DEFAULT_NAME, &[])
            .expect("the embedded default config is valid (checked by a unit test)")
    }

    /// Reads a config file, applies `--set key=value` overrides and validates.
    pub fn load(path: &Path, sets: &[String]) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            file: file.clone(),
            source,
        })?;
        Config::from_yaml_str(&text, &file, sets)
    }

    /// Parses YAML text named `file`, applies overrides and validates.
    pub fn from_yaml_str(text: &str, file: &str, sets: &[String]) -> Result<Config, ConfigError> {
        let mut value: serde_json::Value =
            serde_saphyr::from_str(text).map_err(|e| ConfigError::Yaml {
                file: file.into(),
                msg: e.to_string(),
            })?;
        for arg in sets {
            apply_set(&mut value, arg)?;
        }
        Config::from_value(value, file).map_err(|e| with_sets(e, sets))
    }

    /// Reads the typed schema from a JSON value and validates it.
    pub fn from_value(value: serde_json::Value, file: &str) -> Result<Config, ConfigError> {
        let mut config: Config = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            ConfigError::Key {
                file: file.into(),
                key: if key == "." { "<root>".into() } else { key },
                msg: e.into_inner().to_string(),
            }
        })?;
        config.validate().map_err(|(key, msg)| ConfigError::Key {
            file: file.into(),
            key,
            msg,
        })?;
        config.complete_counts();
        Ok(config)
    }

    /// Fills the batch counts a config left out (`rollout_batch_size`, `val_batch_size`, each
    /// manager's `num_env_groups`) with the values its groups give; [`Config::validate`] has
    /// checked the ones it states.
    pub fn complete_counts(&mut self) {
        for m in [&mut self.train_env_manager, &mut self.val_env_manager] {
            m.num_env_groups = Some(m.groups());
        }
        self.rollout_batch_size = Some(self.train_env_manager.batch_size());
        self.val_batch_size = Some(self.val_env_manager.batch_size());
    }

    /// The run directory: `output_dir`, else `runs/<exp_name>`.
    pub fn run_dir(&self) -> PathBuf {
        match &self.output_dir {
            Some(dir) => PathBuf::from(dir),
            None => PathBuf::from("runs").join(&self.exp_name),
        }
    }

    /// Credit-assignment settings for `algo::compute_advantages`.
    pub fn advantage_config(&self) -> AdvantageConfig {
        AdvantageConfig {
            adv_estimator: self.adv_estimator,
            gamma: self.gamma,
            lambd: self.lambd,
            whiten_advantages: self.whiten_advantages,
            advantage_clip: self.advantage_clip,
            reward_clip: self.reward_clip,
            reward_normalization: self.reward_normalization.clone(),
            step_reward_gamma: self.step_reward_gamma,
            gigpo: self.gigpo.clone(),
            clamp_invalid_advantages: self.clamp_invalid_advantages,
        }
    }

    /// StarPO-S filter settings.
    pub fn filter_config(&self) -> FilterConfig {
        FilterConfig {
            filter_type: self.rollout_filter_type,
            keep_ratio: self.rollout_filter_ratio,
        }
    }

    /// Actor and critic loss settings.
    pub fn loss_config(&self) -> LossConfig {
        LossConfig {
            ratio_type: self.ratio_type,
            pg_clip: self.pg_clip_low,
            pg_clip_low: Some(self.pg_clip_low),
            pg_clip_high: Some(self.pg_clip_high),
            dual_clip_loss: self.dual_clip_loss,
            loss_agg_mode: self.loss_agg_mode,
            entropy_loss_coef: self.entropy_loss_coef,
            negative_unlikelihood_coef: self.negative_unlikelihood_coef,
            value_clip: self.critic.value_clip,
            kl: KlConfig {
                coef: if self.use_kl_loss {
                    self.kl_loss_coef
                } else {
                    0.0
                },
                estimator: self.kl_penalty,
                mode: KlMode::Loss,
            },
            ..LossConfig::default()
        }
    }

    /// Whether the run keeps a frozen reference policy (KL in the reward or as a loss).
    pub fn keeps_reference(&self) -> bool {
        self.init_kl_coef > 0.0 || self.use_kl_loss
    }

    /// AdamW settings (actor `learning_rate`, `critic.learning_rate`).
    /// The critic's optimizer: `critic.learning_rate` and `critic.weight_decay`, the actor's
    /// schedule, warm-up and gradient clip.
    pub fn critic_optimizer_config(&self) -> OptimizerConfig {
        OptimizerConfig {
            lr: self.critic.learning_rate,
            weight_decay: self.critic.weight_decay,
            ..self.optimizer_config()
        }
    }

    /// The actor's optimizer (`critic_lr` is the critic's learning rate for the schedule).
    pub fn optimizer_config(&self) -> OptimizerConfig {
        OptimizerConfig {
            lr: self.learning_rate,
            critic_lr: self.critic.learning_rate,
            weight_decay: self.weight_decay,
            warmup_steps: self.warmup_steps,
            schedule: self.lr_schedule,
            max_grad_norm: Some(self.max_grad_norm as f64),
            ..OptimizerConfig::default()
        }
    }

    /// Checks cross-field rules; the error is (dotted key, message).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let fail = |key: &str, msg: String| Err((key.to_string(), msg));
        self.validate_env_manager("train_env_manager", &self.train_env_manager)?;
        self.validate_env_manager("val_env_manager", &self.val_env_manager)?;
        if let Some(gateway) = &self.gateway {
            gateway.validate()?;
        }
        for (key, given, m) in [
            (
                "rollout_batch_size",
                self.rollout_batch_size,
                &self.train_env_manager,
            ),
            ("val_batch_size", self.val_batch_size, &self.val_env_manager),
        ] {
            let manager = if key == "rollout_batch_size" {
                "train_env_manager"
            } else {
                "val_env_manager"
            };
            match given {
                Some(n) if n != m.batch_size() => {
                    return fail(
                        key,
                        format!(
                            "must equal {manager}'s groups × group_size = {} × {} = {}, got {n} \
                             (leave it out to have it computed)",
                            m.groups(),
                            m.group_size,
                            m.batch_size()
                        ),
                    )
                }
                _ => {}
            }
        }
        if self.max_steps == 0 {
            return fail("max_steps", "must be at least 1".into());
        }
        if self.ppo_epochs == 0 {
            return fail("ppo_epochs", "must be at least 1".into());
        }
        let rollout_batch = self.train_env_manager.batch_size();
        if self.ppo_mini_batch_size == 0 || self.ppo_mini_batch_size > rollout_batch {
            return fail(
                "ppo_mini_batch_size",
                format!(
                    "must be in 1..={} (rollout_batch_size), got {}",
                    rollout_batch, self.ppo_mini_batch_size
                ),
            );
        }
        check_positive("learning_rate", self.learning_rate)?;
        check_unit("gamma", self.gamma)?;
        check_unit("lambd", self.lambd)?;
        if self.rollout_filter_ratio.is_nan()
            || self.rollout_filter_ratio <= 0.0
            || self.rollout_filter_ratio > 1.0
        {
            return fail(
                "rollout_filter_ratio",
                format!("must be in (0, 1], got {}", self.rollout_filter_ratio),
            );
        }
        check_positive("pg_clip_low", self.pg_clip_low as f64)?;
        check_positive("pg_clip_high", self.pg_clip_high as f64)?;
        check_positive("max_grad_norm", self.max_grad_norm as f64)?;
        if let Some(c) = self.advantage_clip {
            check_positive("advantage_clip", c as f64)?;
        }
        for (key, coef) in [
            ("init_kl_coef", self.init_kl_coef),
            ("kl_loss_coef", self.kl_loss_coef),
            (
                "negative_unlikelihood_coef",
                self.negative_unlikelihood_coef,
            ),
        ] {
            if !(coef.is_finite() && coef >= 0.0) {
                return fail(key, format!("must be a finite number ≥ 0, got {coef}"));
            }
        }
        if self.use_kl_loss && self.kl_loss_coef == 0.0 {
            return fail(
                "kl_loss_coef",
                "must be > 0 when use_kl_loss is true".into(),
            );
        }
        if self.adv_estimator.needs_critic() && self.critic.mode == CriticMode::None {
            return fail(
                "critic.mode",
                format!("adv_estimator {:?} needs a critic", self.adv_estimator),
            );
        }
        if self.critic.mode == CriticMode::State && self.gateway.is_some() {
            return fail(
                "critic.mode",
                "state reads the env's facts about the whole state, which the gateway's outside \
                 agents do not send; use separate, shared or features (or none with a \
                 critic-free adv_estimator such as step_reinforce)"
                    .into(),
            );
        }
        check_positive("critic.learning_rate", self.critic.learning_rate)?;
        self.validate_lora()?;
        if self.critic.pretrain.is_some() && self.critic.mode != CriticMode::Separate {
            return fail(
                "critic.pretrain",
                format!(
                    "only a separate critic starts from a checkpoint; critic.mode is {:?}",
                    self.critic.mode
                ),
            );
        }
        match self.critic.ppo_epochs {
            Some(0) => return fail("critic.ppo_epochs", "must be at least 1".into()),
            Some(n) if n < self.ppo_epochs && self.critic.mode == CriticMode::Shared => {
                return fail(
                    "critic.ppo_epochs",
                    format!(
                        "a shared value head trains in the actor's backward, so it needs at \
                         least ppo_epochs ({}) passes, got {n}",
                        self.ppo_epochs
                    ),
                )
            }
            _ => {}
        }
        if let Some(c) = self.critic.value_clip {
            check_positive("critic.value_clip", c as f64)?;
        }
        match self.critic.history_batches {
            0 => return fail("critic.history_batches", "must be at least 1".into()),
            n if n > 1 && !matches!(self.critic.mode, CriticMode::State | CriticMode::None) => {
                return fail(
                    "critic.history_batches",
                    format!(
                        "only a state critic refits on earlier batches (their critic states do \
                         not change with the policy); critic.mode is {}: set \
                         critic.history_batches to 1",
                        config_name(&self.critic.mode)
                    ),
                )
            }
            _ => {}
        }
        let train = &self.train_env_manager;
        let uses_group_mean = matches!(
            self.adv_estimator,
            Estimator::Reinforce | Estimator::StepReinforce
        ) && self.reward_normalization.grouping() == Grouping::TrajGroupId
            && self.reward_normalization.method() != NormMethod::Identity;
        if uses_group_mean && train.group_size == 1 {
            return fail(
                "reward_normalization.grouping",
                "traj_group_id with train_env_manager.group_size 1 makes every advantage zero (ROLL #397)".into(),
            );
        }
        if self.adv_estimator == Estimator::Rloo && train.group_size < 2 {
            return fail(
                "train_env_manager.group_size",
                "rloo needs at least 2 trajectories per group".into(),
            );
        }
        for (tag, spec) in &self.custom_envs {
            // Offline: a remote env's server need not be up yet (its actions are checked when a
            // rollout builds the answer grammar).
            let check = match crate::env::check_config(&spec.env_type, &spec.env_config) {
                Ok(check) => check,
                Err(e) => return fail(&format!("custom_envs.{tag}"), e.to_string()),
            };
            let free_text = check
                .action_space
                .is_some_and(|space| !matches!(space, crate::env::ActionSpace::Named(_)));
            if check.tools && self.context != ContextLayout::Concat {
                return fail(
                    "context",
                    format!("env `{tag}` has tools: true, whose conversation grows turn by turn: set context: concat"),
                );
            }
            if check.tools && self.constrained_decoding {
                return fail(
                    "constrained_decoding",
                    format!("env `{tag}` has tools: true, whose replies are function calls, which the answer grammar does not describe"),
                );
            }
            if self.constrained_decoding && free_text {
                return fail(
                    "constrained_decoding",
                    format!("env `{tag}` ({}) answers free text, which the answer grammar cannot enumerate", spec.env_type),
                );
            }
        }
        if self.cache.kv_slots == 0 {
            return fail("cache.kv_slots", "must be at least 1".into());
        }
        self.validate_prefill_attention()?;
        let algo = [
            self.advantage_config().validate(),
            self.filter_config().validate(),
            self.loss_config().validate(),
            self.optimizer_config().validate(),
        ];
        if let Some(Err(e)) = algo.into_iter().find(Result::is_err) {
            return Err(match e {
                crate::algo::AlgoError::InvalidConfig { key, reason } => (key, reason),
                other => ("<algorithm>".into(), other.to_string()),
            });
        }
        self.validate_generating_args("generating_args", &self.generating_args)?;
        self.validate_generating_args("val_generating_args", &self.val_generating_args)?;
        if self.sft.steps > 0 {
            if self.sft.episodes == 0 || self.sft.batch_size == 0 {
                return fail(
                    "sft.episodes",
                    "sft.episodes and sft.batch_size must be at least 1 when sft.steps > 0".into(),
                );
            }
            check_positive("sft.learning_rate", self.sft.learning_rate)?;
            self.validate_value_warmup()?;
            if let Err(reason) = self.sft.agent.parse::<crate::env::AgentKind>() {
                return fail("sft.agent", reason);
            }
        }
        self.check_env_tags("sft", &self.sft.tags)?;
        if self.sft.copy.steps > 0 {
            if self.sft.copy.batch_size == 0 || self.sft.copy.length < 4 {
                return fail(
                    "sft.copy",
                    "sft.copy needs batch_size >= 1 and length >= 4 when steps > 0".into(),
                );
            }
            check_positive("sft.learning_rate", self.sft.learning_rate)?;
        }
        self.validate_copy_target()?;
        self.validate_self_imitation()?;
        self.validate_async_rollout()?;
        Ok(())
    }

    /// `cache.prefill_attention: flash` runs only where candle-flash-attn does: compiled in, on
    /// CUDA, over bf16 K/V.
    fn validate_prefill_attention(&self) -> Result<(), (String, String)> {
        let kernel = self.cache.prefill_attention;
        if kernel != PrefillAttention::Flash {
            return Ok(());
        }
        let reason = if !kernel.compiled() {
            "stepppo was built without the `flash-attn` feature (cargo build --release --features flash-attn)"
        } else if self.device != DeviceKind::Cuda {
            "flash-attention runs on CUDA only: set device: cuda or prefill_attention: paged"
        } else if self.rollout_dtype == Some(Precision::F32) {
            "flash-attention runs on bf16 K/V only: set rollout_dtype: bf16 or prefill_attention: paged"
        } else {
            return Ok(());
        };
        Err(("cache.prefill_attention".into(), reason.into()))
    }

    /// `sft.copy.until_probability`: a probability in (0, 1] with room above `steps`;
    /// `max_steps` means nothing without it. Both are ignored, as the rest of `sft.copy`, when
    /// the copy pre-training is off (`steps` 0).
    fn validate_lora(&self) -> Result<(), (String, String)> {
        for (prefix, spec) in [("lora", &self.lora), ("critic.lora", &self.critic.lora)] {
            if let Some(Err(message)) = spec.as_ref().map(|l| l.validate_for_training()) {
                let (key, message) = message.split_once(": ").unwrap_or(("", &message));
                return Err((format!("{prefix}.{key}"), message.to_string()));
            }
        }
        if self.critic.lora.is_some() && self.critic.mode != CriticMode::Separate {
            return Err((
                "critic.lora".into(),
                format!(
                    "adapters need a critic model of their own (critic.mode separate), not {}",
                    format!("{:?}", self.critic.mode).to_lowercase()
                ),
            ));
        }
        if self.lora_enabled() && self.critic.mode == CriticMode::Shared {
            return Err((
                "critic.mode".into(),
                "a shared value head reads the policy's trunk, which LoRA freezes; use a \
                 separate, features or state critic"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Where a fresh run's policy comes from, as `pretrain` names it.
    pub fn pretrain_source(&self) -> PretrainSource<'_> {
        if self.pretrain == "builtin" {
            PretrainSource::Builtin(self.builtin_size)
        } else if self.pretrain.ends_with(".json") {
            PretrainSource::Shape(Path::new(&self.pretrain))
        } else {
            PretrainSource::Checkpoint(Path::new(&self.pretrain))
        }
    }

    /// Whether the run trains LoRA adapters (`lora` or `pretrain_adapter` set).
    pub fn lora_enabled(&self) -> bool {
        self.lora.is_some() || self.pretrain_adapter.is_some()
    }

    fn validate_copy_target(&self) -> Result<(), (String, String)> {
        let fail = |key: &str, msg: String| Err((key.to_string(), msg));
        let copy = &self.sft.copy;
        match copy.until_probability {
            _ if copy.steps == 0 => Ok(()),
            None if copy.max_steps > 0 => fail(
                "sft.copy.max_steps",
                "sft.copy.max_steps caps sft.copy.until_probability, which is not set".into(),
            ),
            None => Ok(()),
            Some(p) if !(p > 0.0 && p <= 1.0) => fail(
                "sft.copy.until_probability",
                format!("must lie in (0, 1], got {p}"),
            ),
            Some(_) if copy.max_steps <= copy.steps => fail(
                "sft.copy.max_steps",
                format!(
                    "sft.copy.until_probability needs max_steps above steps (steps {}, max_steps \
                     {})",
                    copy.steps, copy.max_steps
                ),
            ),
            Some(_) => Ok(()),
        }
    }

    /// `async_rollout`: a cap of at least 1; no outside rollout source (the gateway's agents
    /// play with the trainer's current weights).
    fn validate_async_rollout(&self) -> Result<(), (String, String)> {
        let a = &self.async_rollout;
        let cap = a.behaviour_weight_cap;
        if !(cap.is_finite() && cap >= 1.0) {
            return Err((
                "async_rollout.behaviour_weight_cap".into(),
                format!("must be a finite number ≥ 1, got {cap}"),
            ));
        }
        if a.is_async() && self.gateway.is_some() {
            return Err((
                "async_rollout.staleness".into(),
                "must be 0 with a gateway: outside agents generate with the trainer's current \
                 weights between updates"
                    .into(),
            ));
        }
        Ok(())
    }

    /// `self_imitation`: finite, non-negative weights; sizes of at least 1 when it is on.
    fn validate_self_imitation(&self) -> Result<(), (String, String)> {
        let si = &self.self_imitation;
        let fail = |key: &str, msg: String| Err((format!("self_imitation.{key}"), msg));
        for (key, value) in [("coef", si.coef), ("margin", si.margin)] {
            if !(value.is_finite() && value >= 0.0) {
                return fail(key, format!("must be a finite number ≥ 0, got {value}"));
            }
        }
        if si.coef == 0.0 {
            return Ok(());
        }
        for (key, size) in [
            ("buffer_size", si.buffer_size),
            ("batch_size", si.batch_size),
        ] {
            if size == 0 {
                return fail(
                    key,
                    "must be at least 1 when self_imitation.coef > 0".into(),
                );
            }
        }
        Ok(())
    }

    fn validate_env_manager(
        &self,
        key: &str,
        m: &EnvManagerConfig,
    ) -> Result<(), (String, String)> {
        let fail = |sub: &str, msg: String| Err((format!("{key}.{sub}"), msg));
        if m.group_size == 0 {
            return fail("group_size", "must be at least 1".into());
        }
        if m.tags.is_empty() {
            return fail("tags", "must name at least one env of custom_envs".into());
        }
        match m.num_levels {
            Some(0) => return fail("num_levels", "must be at least 1".into()),
            Some(_) if key == "val_env_manager" => {
                return fail(
                    "num_levels",
                    "validation always plays levels training never saw; only \
                     train_env_manager takes num_levels"
                        .into(),
                )
            }
            _ => {}
        }
        if m.tags.len() != m.num_groups_partition.len() {
            return fail(
                "num_groups_partition",
                format!(
                    "has {} entries but tags has {}",
                    m.num_groups_partition.len(),
                    m.tags.len()
                ),
            );
        }
        let total = m
            .num_groups_partition
            .iter()
            .try_fold(0usize, |sum, &n| sum.checked_add(n));
        let Some(total) = total else {
            return fail("num_groups_partition", "its sum overflows".into());
        };
        if total == 0 {
            return fail(
                "num_groups_partition",
                "must sum to at least 1 group".into(),
            );
        }
        if total.checked_mul(m.group_size).is_none() {
            return fail(
                "group_size",
                format!("groups × group_size = {total} × {} overflows", m.group_size),
            );
        }
        if let Some(n) = m.num_env_groups.filter(|&n| n != total) {
            return fail(
                "num_env_groups",
                format!(
                    "is {n} but num_groups_partition sums to {total} (leave num_env_groups out \
                     to have it computed)"
                ),
            );
        }
        self.check_env_tags(key, &m.tags)
    }

    /// Every entry of `tags` (the value of `key`) names an env of `custom_envs`.
    fn check_env_tags(&self, key: &str, tags: &[String]) -> Result<(), (String, String)> {
        match tags
            .iter()
            .position(|tag| !self.custom_envs.contains_key(tag))
        {
            None => Ok(()),
            Some(i) => Err((
                format!("{key}.tags[{i}]"),
                format!(
                    "`{}` is not a key of custom_envs (have: {})",
                    tags[i],
                    self.custom_envs
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    /// `sft.value_loss_coef`: finite, ≥ 0, and only with a step-start critic;
    /// `critic.warmup_steps` only with a critic.
    fn validate_value_warmup(&self) -> Result<(), (String, String)> {
        let fail = |msg: String| Err(("sft.value_loss_coef".to_string(), msg));
        let coef = self.sft.value_loss_coef;
        if !(coef.is_finite() && coef >= 0.0) {
            return fail(format!("must be a finite number ≥ 0, got {coef}"));
        }
        let has_critic = self.adv_estimator.critic_target().is_some();
        if self.critic.warmup_steps > 0 && !(has_critic && self.critic.mode != CriticMode::None) {
            return Err((
                "critic.warmup_steps".into(),
                format!(
                    "trains a critic, and adv_estimator {:?} with critic.mode {:?} has none",
                    self.adv_estimator, self.critic.mode
                ),
            ));
        }
        if coef > 0.0 && matches!(self.critic.mode, CriticMode::Features | CriticMode::State) {
            return fail(
                "a feature or state critic is an MLP fitted during RL; the warm start cannot \
                 train it (warm it up with critic.warmup_steps)"
                    .into(),
            );
        }
        if coef > 0.0 && self.critic.mode == CriticMode::Separate && self.critic.pretrain.is_none()
        {
            return fail(
                "a separate critic with no critic.pretrain is copied from the policy after the \
                 warm start, so there is none to warm up during it (set critic.pretrain, or warm \
                 the critic up with critic.warmup_steps)"
                    .into(),
            );
        }
        let step_start = self.adv_estimator.critic_target() == Some(CriticTarget::StepStart);
        if coef > 0.0 && !step_start {
            return fail(format!(
                "the critic warm-up regresses step-start values; adv_estimator {:?} has none \
                     (use step_gae or set it to 0)",
                self.adv_estimator
            ));
        }
        Ok(())
    }

    fn validate_generating_args(
        &self,
        key: &str,
        g: &GeneratingArgs,
    ) -> Result<(), (String, String)> {
        if g.max_new_tokens == 0 {
            return Err((format!("{key}.max_new_tokens"), "must be at least 1".into()));
        }
        if g.do_sample && (g.temperature.is_nan() || g.temperature <= 0.0) {
            return Err((
                format!("{key}.temperature"),
                format!("must be > 0 when sampling, got {}", g.temperature),
            ));
        }
        if g.top_p.is_nan() || g.top_p <= 0.0 || g.top_p > 1.0 {
            return Err((
                format!("{key}.top_p"),
                format!("must be in (0, 1], got {}", g.top_p),
            ));
        }
        Ok(())
    }
}

fn check_positive(key: &str, x: f64) -> Result<(), (String, String)> {
    if x > 0.0 && x.is_finite() {
        Ok(())
    } else {
        Err((key.into(), format!("must be a positive number, got {x}")))
    }
}

fn check_unit(key: &str, x: f32) -> Result<(), (String, String)> {
    if (0.0..=1.0).contains(&x) {
        Ok(())
    } else {
        Err((key.into(), format!("must be in [0, 1], got {x}")))
    }
}

/// The dotted keys whose values differ between two configs (leaves of their JSON forms, so
/// defaults written out and defaults left implicit compare equal).
pub fn changed_keys(a: &Config, b: &Config) -> Vec<String> {
    let as_value = |c: &Config| serde_json::to_value(c).expect("a config serialises");
    let mut keys = Vec::new();
    diff_values(&as_value(a), &as_value(b), String::new(), &mut keys);
    keys
}

fn diff_values(a: &serde_json::Value, b: &serde_json::Value, at: String, out: &mut Vec<String>) {
    use serde_json::Value::Object;
    match (a, b) {
        (Object(x), Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            let null = serde_json::Value::Null;
            for k in keys {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                diff_values(
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    path,
                    out,
                );
            }
        }
        _ if a != b => out.push(at),
        _ => {}
    }
}

/// Checks that `given` continues the run whose checkpoint holds `stored` (named `file` in the
/// error): only the keys in [`RESUME_OVERRIDABLE`] may differ.
pub fn check_resume(stored: &Config, given: &Config, file: &str) -> Result<(), ConfigError> {
    let keys: Vec<String> = changed_keys(stored, given)
        .into_iter()
        .filter(|k| !RESUME_OVERRIDABLE.contains(&k.as_str()))
        .collect();
    if keys.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::ResumeMismatch {
            file: file.into(),
            keys,
        })
    }
}

/// A key error of a config read with `--set` overrides names them beside the file: the value at
/// fault, or one a rule compares it with, may be an override's rather than the file's.
fn with_sets(error: ConfigError, sets: &[String]) -> ConfigError {
    match error {
        ConfigError::Key { file, key, msg } if !sets.is_empty() => {
            let sets: Vec<String> = sets
                .iter()
                .map(|s| format!("--set {}", shorten(s)))
                .collect();
            ConfigError::Key {
                file: format!("{file} with {}", sets.join(" ")),
                key,
                msg,
            }
        }
        other => other,
    }
}

/// Most keys in one `--set` path: far deeper than any config key, far shallower than what would
/// exhaust the stack when the nested maps it creates are read and dropped.
pub const MAX_SET_DEPTH: usize = 32;

/// Applies one `a.b.c=value` override: the value is read as a YAML scalar or flow collection
/// (`3`, `true`, `null`, `[a, b]`, `{x: 1}`); intermediate maps are created when missing.
/// A list element is addressed by its index (`tags.0=x`).
pub fn apply_set(root: &mut serde_json::Value, arg: &str) -> Result<(), ConfigError> {
    let set_err = |msg: String| ConfigError::Set {
        arg: arg.into(),
        msg,
    };
    let (path, raw) = arg
        .split_once('=')
        .ok_or_else(|| set_err("expected key.path=value".into()))?;
    let path = path.trim();
    if path.is_empty() || path.split('.').any(str::is_empty) {
        return Err(set_err("empty key in the dotted path".into()));
    }
    let depth = path.split('.').count();
    if depth > MAX_SET_DEPTH {
        return Err(set_err(format!(
            "the dotted path has {depth} keys; configs nest at most {MAX_SET_DEPTH} deep"
        )));
    }
    let value: serde_json::Value = if raw.trim().is_empty() {
        serde_json::Value::String(String::new())
    } else {
        serde_saphyr::from_str(raw).map_err(|e| set_err(format!("value is not valid YAML: {e}")))?
    };
    let mut node = root;
    let parts: Vec<&str> = path.split('.').collect();
    for (depth, part) in parts.iter().enumerate() {
        let last = depth + 1 == parts.len();
        let here = parts[..=depth].join(".");
        node = match node {
            serde_json::Value::Object(map) => {
                if last {
                    map.insert(part.to_string(), value);
                    return Ok(());
                }
                map.entry(part.to_string())
                    .or_insert_with(|| serde_json::Value::Object(Default::default()))
            }
            serde_json::Value::Array(items) => {
                let index: usize = part
                    .parse()
                    .map_err(|_| set_err(format!("`{here}`: list index expected")))?;
                let len = items.len();
                let slot = items.get_mut(index).ok_or_else(|| {
                    set_err(format!("`{here}`: index {index} out of range (len {len})"))
                })?;
                if last {
                    *slot = value;
                    return Ok(());
                }
                slot
            }
            serde_json::Value::Null => {
                *node = serde_json::Value::Object(Default::default());
                let map = node.as_object_mut().expect("just made an object");
                if last {
                    map.insert(part.to_string(), value);
                    return Ok(());
                }
                map.entry(part.to_string())
                    .or_insert_with(|| serde_json::Value::Object(Default::default()))
            }
            _ => {
                return Err(set_err(format!(
                    "`{}` is a scalar, cannot set a key under it",
                    parts[..depth].join(".")
                )))
            }
        };
    }
    unreachable!("the loop returns at the last path part")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded default with `sets` applied as `--set` overrides, after a history of one
    /// batch: the default's state-critic history is refused by the other critics these tests
    /// switch to.
    fn with(sets: &[&str]) -> Result<Config, ConfigError> {
        let sets: Vec<String> = std::iter::once("critic.history_batches=1")
            .chain(sets.iter().copied())
            .map(str::to_string)
            .collect();
        Config::from_yaml_str(EMBEDDED_DEFAULT_YAML, "x.yaml", &sets)
    }

    fn err_text(r: Result<Config, ConfigError>) -> String {
        r.expect_err("expected a config error").to_string()
    }

    #[test]
    fn overflowing_sizes_and_runaway_set_paths_are_errors() {
        let huge = format!("train_env_manager.group_size={}", usize::MAX / 2);
        let err = err_text(with(&[huge.as_str()]));
        assert!(
            err.contains("group_size") && err.contains("overflows"),
            "{err}"
        );
        let parts = format!("train_env_manager.num_groups_partition=[{}, 2]", usize::MAX);
        let err = err_text(with(&[parts.as_str()]));
        assert!(err.contains("num_groups_partition"), "{err}");
        let deep = format!("{}x=1", "a.".repeat(60_000));
        let err = err_text(with(&[deep.as_str()]));
        assert!(err.contains("at most 32 deep") && err.len() < 400, "{err}");
    }

    #[test]
    fn embedded_default_is_valid() {
        let c = Config::embedded_default();
        assert_eq!(c.adv_estimator, Estimator::StepGae);
        assert_eq!(c.critic.mode, CriticMode::State);
        assert!(c.constrained_decoding && !c.use_kl_loss);
        assert_eq!(
            c.rollout_batch_size,
            Some(c.train_env_manager.groups() * c.train_env_manager.group_size)
        );
    }

    #[test]
    fn every_shipped_config_is_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "yaml") {
                Config::load(&path, &[]).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n >= 7, "expected the 7 ready configs, found {n}");
    }

    #[test]
    fn flash_prefill_attention_where_it_cannot_run_is_an_error_naming_the_key() {
        assert!(with(&["cache.prefill_attention=paged"]).is_ok());
        let on_cpu = err_text(with(&["cache.prefill_attention=flash"]));
        assert!(on_cpu.contains("cache.prefill_attention"), "{on_cpu}");
        let want = if cfg!(feature = "flash-attn") {
            "CUDA only"
        } else {
            "without the `flash-attn` feature"
        };
        assert!(on_cpu.contains(want), "{on_cpu}");
        let e = err_text(with(&["cache.prefill_attention=flush"]));
        assert!(e.contains("cache.prefill_attention"), "{e}");
    }

    #[test]
    fn unknown_key_is_rejected_with_its_path() {
        let e = err_text(Config::from_yaml_str(
            EMBEDDED_DEFAULT_YAML,
            "x.yaml",
            &["generating_args.max_new_tokns=3".into()],
        ));
        assert!(e.contains("x.yaml"), "{e}");
        assert!(e.contains("generating_args"), "{e}");
        assert!(e.contains("max_new_tokns"), "{e}");
    }

    #[test]
    fn type_error_names_the_nested_key() {
        let e = err_text(Config::from_yaml_str(
            EMBEDDED_DEFAULT_YAML,
            "x.yaml",
            &["reward_normalization.method=median".into()],
        ));
        assert!(e.contains("reward_normalization.method"), "{e}");
    }

    #[test]
    fn reward_normalization_an_estimator_does_not_read_is_refused() {
        let e = err_text(with(&["reward_normalization.method=mean"]));
        assert!(e.contains("reward_normalization.method"), "{e}");
        assert!(e.contains("step_gae normalises no rewards"), "{e}");
        let grpo = ["adv_estimator=grpo", "critic.mode=none"];
        assert!(with(&[&grpo[..], &["reward_normalization.method=mean"]].concat()).is_ok());
        let dr_grpo = ["adv_estimator=dr_grpo", "critic.mode=none"];
        assert!(with(&[&dr_grpo[..], &["reward_normalization.grouping=batch"]].concat()).is_ok());
        let e = err_text(with(
            &[&dr_grpo[..], &["reward_normalization.method=mean"]].concat(),
        ));
        assert!(
            e.contains("dr_grpo reads only reward_normalization.grouping"),
            "{e}"
        );
    }

    #[test]
    fn a_finite_level_set_is_for_training_only() {
        assert!(with(&["train_env_manager.num_levels=64"]).is_ok());
        let e = err_text(with(&["train_env_manager.num_levels=0"]));
        assert!(e.contains("train_env_manager.num_levels"), "{e}");
        let e = err_text(with(&["val_env_manager.num_levels=64"]));
        assert!(e.contains("val_env_manager.num_levels"), "{e}");
    }

    #[test]
    fn critic_settings_the_chosen_critic_cannot_use_are_errors() {
        let gae = "adv_estimator=step_gae";
        assert!(with(&[gae, "critic.mode=features", "critic.ppo_epochs=10"]).is_ok());
        let e = err_text(with(&[gae, "critic.mode=features", "critic.ppo_epochs=0"]));
        assert!(e.contains("critic.ppo_epochs"), "{e}");
        let e = err_text(with(&[
            gae,
            "critic.mode=shared",
            "ppo_epochs=2",
            "critic.ppo_epochs=1",
        ]));
        assert!(
            e.contains("critic.ppo_epochs") && e.contains("shared"),
            "{e}"
        );
        assert!(with(&[gae, "critic.mode=state", "critic.history_batches=32"]).is_ok());
        let e = err_text(with(&[
            gae,
            "critic.mode=state",
            "critic.history_batches=0",
        ]));
        assert!(e.contains("critic.history_batches"), "{e}");
        let e = err_text(with(&[
            gae,
            "critic.mode=features",
            "critic.history_batches=2",
        ]));
        assert!(
            e.contains("critic.history_batches") && e.contains("critic.mode is features"),
            "{e}"
        );
        assert!(with(&[gae, "critic.mode=separate", "critic.pretrain=builtin"]).is_ok());
        let e = err_text(with(&[
            gae,
            "critic.mode=features",
            "critic.pretrain=builtin",
        ]));
        assert!(e.contains("critic.pretrain"), "{e}");
        for mode in ["critic.mode=features", "critic.mode=separate"] {
            let e = err_text(with(&[gae, mode, "sft.value_loss_coef=0.5"]));
            assert!(e.contains("sft.value_loss_coef"), "{mode}: {e}");
        }
        let copied_later = [gae, "critic.mode=separate", "critic.pretrain=builtin"];
        assert!(with(&[&copied_later[..], &["sft.value_loss_coef=0.5"]].concat()).is_ok());
    }

    #[test]
    fn critic_warmup_needs_a_step_start_critic() {
        let step_gae = ["adv_estimator=step_gae", "critic.mode=shared"];
        assert!(with(&[&step_gae[..], &["sft.value_loss_coef=0.5"]].concat()).is_ok());
        let e = err_text(with(&[
            "sft.value_loss_coef=0.5",
            "adv_estimator=grpo",
            "critic.mode=none",
        ]));
        assert!(
            e.contains("sft.value_loss_coef") && e.contains("step_gae"),
            "{e}"
        );
        let e = err_text(with(&["sft.value_loss_coef=-1"]));
        assert!(e.contains("sft.value_loss_coef"), "{e}");
        assert!(with(&[&step_gae[..], &["critic.warmup_steps=5"]].concat()).is_ok());
        let critic_free = [
            "adv_estimator=step_reinforce",
            "critic.mode=none",
            "critic.warmup_steps=5",
        ];
        let e = err_text(with(&critic_free));
        assert!(e.contains("critic.warmup_steps"), "{e}");
    }

    #[test]
    fn self_imitation_needs_sizes() {
        assert!(with(&["self_imitation.coef=0.5"]).is_ok());
        assert!(with(&["self_imitation.coef=0.5", "context=concat"]).is_ok());
        let e = err_text(with(&[
            "self_imitation.coef=0.5",
            "self_imitation.batch_size=0",
        ]));
        assert!(e.contains("self_imitation.batch_size"), "{e}");
        let e = err_text(with(&["self_imitation.margin=-1"]));
        assert!(e.contains("self_imitation.margin"), "{e}");
        let off = [
            "self_imitation.coef=0",
            "context=concat",
            "self_imitation.batch_size=0",
        ];
        assert!(with(&off).is_ok(), "off: unchecked");
    }

    #[test]
    fn async_rollout_needs_a_cap_of_one_and_no_gateway() {
        assert!(with(&["async_rollout.staleness=2"]).is_ok());
        let e = err_text(with(&["async_rollout.behaviour_weight_cap=0.5"]));
        assert!(e.contains("async_rollout.behaviour_weight_cap"), "{e}");
        let gateway = [
            "gateway.listen=127.0.0.1:0",
            "critic.mode=shared",
            "async_rollout.staleness=1",
        ];
        let e = err_text(with(&gateway));
        assert!(
            e.contains("async_rollout.staleness") && e.contains("gateway"),
            "{e}"
        );
        assert!(with(&gateway[..2]).is_ok(), "a synchronous gateway run");
    }

    #[test]
    fn a_state_critic_is_refused_with_a_gateway() {
        let e = err_text(with(&["gateway.listen=127.0.0.1:0"]));
        assert!(e.contains("critic.mode") && e.contains("gateway"), "{e}");
        let critic_free = [
            "gateway.listen=127.0.0.1:0",
            "adv_estimator=step_reinforce",
            "critic.mode=none",
        ];
        assert!(with(&critic_free).is_ok());
    }

    #[test]
    fn kl_loss_needs_a_positive_coefficient_and_keeps_a_reference() {
        let c = with(&[
            "use_kl_loss=true",
            "kl_loss_coef=0.1",
            "kl_penalty=low_var_kl",
        ])
        .unwrap();
        assert!(c.keeps_reference());
        let kl = c.loss_config().kl;
        assert_eq!((kl.coef, kl.estimator), (0.1, KlEstimator::K3));
        let off = with(&["use_kl_loss=false"]).unwrap();
        assert!(!off.keeps_reference());
        assert_eq!(off.loss_config().kl.coef, 0.0);
        let e = err_text(with(&["use_kl_loss=true", "kl_loss_coef=0"]));
        assert!(
            e.contains("kl_loss_coef") && e.contains("use_kl_loss"),
            "{e}"
        );
        let e = err_text(with(&["use_kl_loss=true", "kl_loss_coef=-1"]));
        assert!(e.contains("kl_loss_coef"), "{e}");
    }

    #[test]
    fn constrained_decoding_needs_envs_with_named_actions() {
        assert!(with(&["constrained_decoding=true"]).is_ok());
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let qa = Config::load(
            &dir.join("hotpotqa_steppo.yaml"),
            &["constrained_decoding=true".into()],
        );
        let e = err_text(qa);
        assert!(
            e.contains("constrained_decoding") && e.contains("free text"),
            "{e}"
        );
    }

    #[test]
    fn batch_rule_names_the_key() {
        let e = err_text(Config::from_yaml_str(
            EMBEDDED_DEFAULT_YAML,
            "x.yaml",
            &[
                "train_env_manager.group_size=3".into(),
                "rollout_batch_size=64".into(),
            ],
        ));
        assert!(
            e.contains("rollout_batch_size") && e.contains("got 64"),
            "{e}"
        );
        let e = err_text(Config::from_yaml_str(
            EMBEDDED_DEFAULT_YAML,
            "x.yaml",
            &["val_env_manager.num_env_groups=3".into()],
        ));
        assert!(e.contains("val_env_manager.num_env_groups"), "{e}");
    }

    #[test]
    fn set_overrides_scalars_lists_and_nested_keys() {
        let c = Config::from_yaml_str(
            EMBEDDED_DEFAULT_YAML,
            "x.yaml",
            &[
                "learning_rate=0.5".into(),
                "generating_args.temperature=0.7".into(),
                "adv_estimator=grpo".into(),
                "critic.value_clip=0.5".into(),
                "advantage_clip=null".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.learning_rate, 0.5);
        assert_eq!(c.generating_args.temperature, 0.7);
        assert_eq!(c.adv_estimator, Estimator::Reinforce);
        assert_eq!(c.critic.value_clip, Some(0.5));
        assert_eq!(c.advantage_clip, None);
    }

    #[test]
    fn set_reaches_list_elements_and_rejects_bad_paths() {
        let mut v: serde_json::Value = serde_saphyr::from_str("a: {b: [1, 2]}\nc: 3\n").unwrap();
        apply_set(&mut v, "a.b.1=x").unwrap();
        assert_eq!(v["a"]["b"][1], "x");
        assert!(apply_set(&mut v, "a.b.9=1").is_err());
        assert!(apply_set(&mut v, "c.d=1").is_err());
        assert!(apply_set(&mut v, "novalue").is_err());
        assert!(apply_set(&mut v, "a..b=1").is_err());
    }

    #[test]
    fn unknown_tag_names_the_list_element() {
        let e = err_text(Config::from_yaml_str(
            EMBEDDED_DEFAULT_YAML,
            "x.yaml",
            &["val_env_manager.tags.0=Nope".into()],
        ));
        assert!(e.contains("val_env_manager.tags[0]"), "{e}");
        let e = err_text(with(&["sft.tags=[SimpleFrozenLake, Nope]"]));
        assert!(
            e.contains("sft.tags[1]") && e.contains("`Nope`") && e.contains("SimpleFrozenLake"),
            "{e}"
        );
        assert!(with(&["sft.tags=[SimpleFrozenLake]"]).is_ok());
    }

    #[test]
    fn bad_env_config_names_the_env_tag() {
        let e = err_text(Config::from_yaml_str(
            EMBEDDED_DEFAULT_YAML,
            "x.yaml",
            &["custom_envs.SimpleFrozenLake.env_config.sizee=4".into()],
        ));
        assert!(e.contains("custom_envs.SimpleFrozenLake"), "{e}");
        assert!(e.contains("sizee"), "{e}");
    }

    #[test]
    fn malformed_yaml_names_the_file() {
        let e = err_text(Config::from_yaml_str("a: [1,", "bad.yaml", &[]));
        assert!(e.starts_with("bad.yaml"), "{e}");
    }

    #[test]
    fn a_copy_target_needs_a_probability_and_room_above_its_steps() {
        let copy = ["sft.copy.steps=100", "sft.copy.length=32"];
        let set = |extra: &[&str]| with(&[&copy[..], extra].concat());
        assert!(set(&["sft.copy.until_probability=0.8", "sft.copy.max_steps=200"]).is_ok());
        for (bad, key) in [
            (&["sft.copy.max_steps=200"][..], "sft.copy.max_steps"),
            (
                &["sft.copy.until_probability=1.5", "sft.copy.max_steps=200"][..],
                "sft.copy.until_probability",
            ),
            (
                &["sft.copy.until_probability=0.8", "sft.copy.max_steps=100"][..],
                "sft.copy.max_steps",
            ),
        ] {
            let e = err_text(set(bad));
            assert!(e.contains(key), "{bad:?}: {e}");
        }
        // Off with the rest of the copy pre-training.
        assert!(with(&["sft.copy.until_probability=0.8", "sft.copy.max_steps=200"]).is_ok());
    }
}
