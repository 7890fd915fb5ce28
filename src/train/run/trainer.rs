//! The training loop of a run directory.
//!
//! One step: rollout with the current policy version through the radix-cached engine (per-group
//! env seeds from a counter kept in the state) → every step record appended to
//! `<run>/dataset` → StarPO-S group filter → critic values and advantages (algo estimators) → PPO
//! epochs over mini-batches (actor and critic) → policy version + 1 (the engine's cache is flushed
//! so no KV of old weights is served). Validation runs every `eval_steps` (and at step 0, the
//! warm-started base), checkpoints every `save_steps` and at the end; a checkpoint holds the
//! weights, both AdamW states, the config and the [`TrainState`] counters, so a resumed run
//! continues exactly where it stopped. With `init_kl_coef > 0` or `use_kl_loss` the policy as
//! training starts is frozen into `<run>/reference/`; every response token's reward is charged
//! `init_kl_coef · KL` against it, and/or the actor loss gains `kl_loss_coef · KL`. With
//! `self_imitation.coef > 0` each rollout's better choices enter a replay buffer
//! ([`crate::train::learner::self_imitation`]) before the update replays them; the buffer goes into every
//! checkpoint, as does a state critic's fitting history ([`crate::train::learner::critic::history`]). Every RNG is
//! derived from `seed` and those counters. With `async_rollout` the rollout runs ahead of the
//! step in a thread of its own ([`crate::train::run::async_rollout`]) and the update corrects for the lag
//! with decoupled PPO (`algo::decoupled`); its pending batches go into every checkpoint.
//!
//! An env that fails (a remote env's server) ends the run with its error under `on_error: fail`,
//! before anything of that rollout is stored: the records of the steps before it stay in the
//! dataset. Under `skip` the failed groups are dropped, counted in `rollout/env_errors` (and
//! `val/env_errors`) and reported as warnings.

use crate::algo::config::LossAggMode;
use crate::algo::filter::group_reward_std;
use crate::algo::loss::VarianceParts;
use crate::algo::value_fit::tabular_ceiling;
use crate::algo::{
    compute_advantages, kl_reward_penalty, step_returns, uncertainty_filter, AdamW,
    AdvantageInputs, CriticTarget, LrSchedule, ProximalCorrection,
};
use crate::config::{config_name, Config, CriticMode, PretrainSource, ProximalPolicy};
use crate::crash;
use crate::dist::shard::Sharding;
use crate::dist::{Collective, Metered, Single};
use crate::env::AgentKind;
use crate::model::checkpoint::chat_template_note;
use crate::model::{Critic as CriticTrunk, LoraSpec, Model, Precision};
use crate::rollout::engine::{CacheCounters, Engine};
use crate::rollout::grammar::ResponseGrammar;
use crate::seed;
use crate::store::{DatasetWriter, SegmentEntry, StepRecord, WriterOptions};
use crate::tokenizer::Tokenizer;
use crate::train::learner::batch::context_sequences;
use crate::train::learner::critic::{self, Critic, CriticOrigin, ValueReading};
use crate::train::learner::device_batch::BatchLayout;
use crate::train::learner::masks::{response_masks, ResponseMasks};
use crate::train::learner::memory_plan::{MemoryBudget, GIB};
use crate::train::learner::ranks;
use crate::train::learner::scoring::response_logprobs;
use crate::train::learner::self_imitation::{self, Replay, ReplayBuffer};
use crate::train::learner::update::{
    self, CriticLearner, Learners, StepRatios, UpdateInputs, UpdateReport, UpdateSettings,
};
use crate::train::run::async_rollout::{self, RolloutWorker};
use crate::train::run::checkpoint::{self, CheckpointWriter};
use crate::train::run::collapse::CollapseDetector;
use crate::train::run::credit_log::{CreditLog, StepCredit};
use crate::train::run::eval::{self, TagSummary, Validation, VAL_SEED_OFFSET};
use crate::train::run::metrics::MetricsSink;
use crate::train::run::run_dir::{self, Rewound, RunPosition};
use crate::train::warm_start::copy_pretrain::copy_pretrain;
use crate::train::warm_start::setup::{
    attach_critic_adapters, attach_run_adapters, device_of, engine_for, fresh_policy,
    run_lora_spec, WARM_START_DIR,
};
use crate::train::warm_start::sft::{self, CloneSettings, SftReport};
use crate::train::Scalars;
use crate::train::TrainError;
use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Counters that, with the config, determine everything a run does next.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Completed training steps = the current policy version.
    pub step: u64,
    /// Next training group id: env seeds are `derive(seed, [group_id])`.
    pub next_group_id: u64,
    /// Updates skipped for a non-finite loss or gradient.
    pub skipped_updates: u64,
}

/// Seed-path tags of the components a run initialises (1, the policy's, is [`crate::train::warm_start::setup`]'s;
/// 2, the critic's, [`crate::train::learner::critic`]'s).
const SEED_SFT: u64 = 3;
const SEED_SHUFFLE: u64 = 4;
const SEED_REPLAY: u64 = 5;
/// Sequences per forward when reading critic values or reference log-probs.
const VALUE_CHUNK: usize = 16;

/// What the loop reports to its caller (progress bar, log lines).
pub enum Event<'a> {
    /// The supervised warm start finished.
    WarmStart(&'a SftReport),
    /// A training step finished with these metrics.
    Step {
        /// Steps completed (the new policy version).
        step: u64,
        /// The step's logged metrics.
        scalars: &'a Scalars,
    },
    /// A validation finished.
    Validation {
        /// Steps completed when it ran.
        step: u64,
        /// Aggregate figures per validation env tag.
        summaries: &'a [TagSummary],
    },
    /// A collapse or zero-signal warning, or a skipped update.
    Warning(String),
    /// A checkpoint was written to this directory (`ckpt-<step>`).
    Checkpoint(&'a Path),
}

/// A training run: models, optimizers, engine, sinks and counters.
pub struct Trainer {
    cfg: Config,
    run_dir: PathBuf,
    tok: Tokenizer,
    policy: Model,
    critic: Option<Box<dyn Critic>>,
    /// The frozen policy the KL penalty and the KL loss are measured against
    /// ([`Config::keeps_reference`]).
    reference: Option<Model>,
    actor_opt: AdamW,
    critic_opt: Option<AdamW>,
    engine: Engine,
    /// This rank's writer of the run's dataset: the lead's (rank 0, which keeps the manifest) or
    /// shard r's (rank r > 0, its own segment files).
    dataset: DatasetWriter,
    /// The run's metrics: rank 0's alone (`None` on the other ranks).
    sink: Option<MetricsSink>,
    /// Rank 0's per-step credit log (`<run>/credit.jsonl`).
    credit_log: Option<CreditLog>,
    /// The data-parallel world this process is a rank of, counting its traffic.
    dist: Arc<Metered>,
    detector: CollapseDetector,
    state: TrainState,
    warm_start: Option<SftReport>,
    /// Constrained decoding on the update side (empty when it is off).
    masks: ResponseMasks,
    /// Self-imitation replay buffer; `None` when `self_imitation.coef` is 0.
    replay_buffer: Option<ReplayBuffer>,
    /// The run's memory plan against the machine's memory; `None` where that is not known.
    memory: Option<MemoryBudget>,
    /// Warnings found while opening the run or during a step or validation, reported with the
    /// next event.
    pending_warnings: Vec<String>,
    /// The rollout thread of `async_rollout` (`None`: rollouts run in the step, synchronously).
    rollout_worker: Option<RolloutWorker>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl Trainer {
    /// Starts a fresh run in `run_dir` (which must not hold one yet): builds or loads the models,
    /// runs the supervised warm start when `sft.steps > 0`.
    pub fn create(cfg: Config, run_dir: &Path) -> Result<Self, TrainError> {
        Self::create_rank(cfg, run_dir, Arc::new(Single))
    }

    /// [`Trainer::create`] as one rank of the data-parallel world `dist`. Rank 0 writes the run
    /// directory and runs the warm start; the others receive its weights, and read what they
    /// need of the directory (the reference policy), which every rank must see (a shared
    /// filesystem).
    pub fn create_rank(
        cfg: Config,
        run_dir: &Path,
        dist: Arc<dyn Collective>,
    ) -> Result<Self, TrainError> {
        let device = device_of(cfg.device)?;
        check_world(&cfg, dist.as_ref())?;
        check_critic_is_read(&cfg)?;
        let lead = dist.rank() == 0;
        if lead {
            run_dir::prepare_fresh(run_dir, false)?;
        }
        let (mut policy, tok) = fresh_policy(&cfg, &device)?;
        let template_note = match cfg.pretrain_source() {
            PretrainSource::Checkpoint(dir) => chat_template_note(&dir.display().to_string(), &tok),
            PretrainSource::Builtin(_) | PretrainSource::Shape(_) => None,
        };
        let mut critic = critic::open(&cfg, &mut policy, CriticOrigin::Fresh)?;
        set_numerics(&cfg, &mut policy, critic.as_mut())?;
        check_memory(&cfg, &policy, run_lora_spec(&cfg)?, dist.size())?;
        // Only now that the device and every model directory were found good does the run
        // directory come into being: a config that fails leaves nothing behind.
        if lead {
            std::fs::create_dir_all(run_dir).map_err(io_err(run_dir))?;
        }
        let warm_start = if (cfg.sft.steps > 0 || cfg.sft.copy.steps > 0) && lead {
            let trunk = critic.as_ref().and_then(|c| c.trunk());
            let report = warm_start(&cfg, &policy, trunk, &tok)?;
            policy.save(&run_dir.join(WARM_START_DIR), Some(&tok))?;
            Some(report)
        } else {
            None
        };
        broadcast_weights(dist.as_ref(), &policy.named_vars())?;
        if let Some(c) = &critic {
            broadcast_weights(dist.as_ref(), &c.broadcast_vars())?;
        }
        let mut critic = critic::complete_fresh(&cfg, &policy, critic)?;
        let warm_started = cfg.sft.steps > 0 || cfg.sft.copy.steps > 0;
        if let Some(c) = critic.as_mut().and_then(|c| c.trunk_mut()) {
            attach_critic_adapters(&cfg, run_dir, (c, &policy, &tok), warm_started, lead)?;
        }
        attach_run_adapters(&cfg, run_dir, (&mut policy, &tok), warm_started, lead)?;
        let reference = if cfg.keeps_reference() && policy.adapters().is_some() {
            Some(policy.without_adapters()?)
        } else if cfg.keeps_reference() {
            if lead {
                policy.save(&run_dir.join(run_dir::REFERENCE_DIR), Some(&tok))?;
            }
            dist.barrier()?;
            Some(load_reference(run_dir, &device)?)
        } else {
            None
        };
        let (actor_opt, critic_opt) = optimizers(&cfg, &policy, critic.as_deref(), dist.as_ref())?;
        if lead {
            let text = serde_json::to_string_pretty(&cfg).expect("a config serialises");
            let path = run_dir.join(run_dir::CONFIG_FILE);
            std::fs::write(&path, text).map_err(io_err(&path))?;
        }
        let dataset = rank_writer(&cfg, run_dir, dist.as_ref(), DatasetWriter::create)?;
        let mut trainer = Self::assemble(
            cfg,
            run_dir,
            tok,
            (policy, critic, reference),
            (actor_opt, critic_opt),
            (dataset, dist),
            TrainState::default(),
            warm_start,
        )?;
        trainer.pending_warnings.extend(template_note);
        trainer.start_async(Vec::new())?;
        Ok(trainer)
    }

    /// Continues the run in `run_dir` from its latest complete checkpoint. `cfg` must be the
    /// run's own config (the checkpoint's, [`run_dir::checkpoint_config`]) up to the keys a
    /// resume may change ([`crate::config::RESUME_OVERRIDABLE`]). The run's dataset and metric
    /// files are first brought back to the checkpoint's position, so steps redone after a crash
    /// are not kept twice.
    pub fn resume(cfg: Config, run_dir: &Path) -> Result<Self, TrainError> {
        Self::resume_rank(cfg, run_dir, Arc::new(Single))
    }

    /// [`Trainer::resume`] as one rank of the data-parallel world `dist`, which may have another
    /// size than the run had (every rank holds the whole state). Rank 0 rewinds the run
    /// directory; then every rank reads the checkpoint.
    pub fn resume_rank(
        cfg: Config,
        run_dir: &Path,
        dist: Arc<dyn Collective>,
    ) -> Result<Self, TrainError> {
        let ckpt = run_dir::checkpoint_to_resume(run_dir)?;
        let stored = run_dir::checkpoint_config(&ckpt, &[])?;
        let stored_name = ckpt.join(run_dir::CONFIG_FILE).display().to_string();
        crate::config::check_resume(&stored, &cfg, &stored_name)?;
        let device = device_of(cfg.device)?;
        check_world(&cfg, dist.as_ref())?;
        let lead = dist.rank() == 0;
        let rewound = if lead {
            rewind_to(run_dir, &ckpt)?
        } else {
            Vec::new()
        };
        dist.barrier()?;
        let (mut policy, tok) = crate::model::checkpoint::load_policy(
            &ckpt.join("policy").display().to_string(),
            &device,
        )?;
        let critic = critic::open(&cfg, &mut policy, CriticOrigin::Checkpoint(&ckpt))?;
        let lora = policy.adapters().map(|a| a.spec().clone());
        check_memory(&cfg, &policy, lora, dist.size())?;
        let (mut actor_opt, mut critic_opt) =
            optimizers(&cfg, &policy, critic.as_deref(), dist.as_ref())?;
        actor_opt.load(&optimizer_state(&ckpt, ACTOR_OPTIMIZER))?;
        if let Some(opt) = critic_opt.as_mut() {
            opt.load(&optimizer_state(&ckpt, CRITIC_OPTIMIZER))?;
        }
        let reference = if cfg.keeps_reference() && policy.adapters().is_some() {
            Some(policy.without_adapters()?)
        } else if cfg.keeps_reference() {
            Some(load_reference(run_dir, &device)?)
        } else {
            None
        };
        let state: TrainState = checkpoint::load_json(&ckpt, "state")?;
        let dataset = rank_writer(&cfg, run_dir, dist.as_ref(), DatasetWriter::open_append)?;
        let mut trainer = Self::assemble(
            cfg,
            run_dir,
            tok,
            (policy, critic, reference),
            (actor_opt, critic_opt),
            (dataset, dist),
            state,
            None,
        )?;
        trainer.pending_warnings.extend(rewound);
        let saved_buffer = ckpt.join(self_imitation::CHECKPOINT_DIR);
        if trainer.replay_buffer.is_some() && saved_buffer.exists() {
            let capacity = trainer.cfg.self_imitation.buffer_size;
            trainer.replay_buffer = Some(ReplayBuffer::load(
                &saved_buffer,
                capacity,
                trainer.cfg.context,
            )?);
        }
        let pending = ckpt.join(async_rollout::PENDING_DIR);
        let restored = if trainer.cfg.async_rollout.is_async() && pending.exists() {
            async_rollout::load_pending(&pending)?
        } else {
            Vec::new()
        };
        trainer.start_async(restored)?;
        Ok(trainer)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        cfg: Config,
        run_dir: &Path,
        tok: Tokenizer,
        (mut policy, mut critic, mut reference): (Model, Option<Box<dyn Critic>>, Option<Model>),
        (actor_opt, critic_opt): (AdamW, Option<AdamW>),
        (dataset, dist): (DatasetWriter, Arc<dyn Collective>),
        state: TrainState,
        warm_start: Option<SftReport>,
    ) -> Result<Self, TrainError> {
        set_numerics(&cfg, &mut policy, critic.as_mut())?;
        if let Some(reference) = reference.as_mut() {
            // The KL term compares like with like: both log-probs in the update's numerics.
            reference.set_precision(cfg.precision);
        }
        // Before the KV pool and the rollout's weights are allocated.
        let memory = MemoryBudget::for_run(
            &cfg,
            policy.config(),
            policy.adapters().map(|a| a.spec().clone()),
            (policy.device(), dist.size()),
        );
        policy.refresh_rollout_weights()?;
        let mut engine = engine_for(&cfg, &policy)?;
        engine.set_policy_version(state.step)?;
        let masks = response_masks(&cfg, &tok, policy.config().vocab_size)?;
        let replay_buffer = (cfg.self_imitation.coef > 0.0)
            .then(|| ReplayBuffer::new(cfg.self_imitation.buffer_size, cfg.context));
        let (sink, credit_log) = match dist.rank() {
            0 => (
                Some(MetricsSink::open(run_dir)?),
                Some(CreditLog::open(run_dir)?),
            ),
            _ => (None, None),
        };
        Ok(Trainer {
            dataset,
            sink,
            credit_log,
            dist: Arc::new(Metered::new(dist)),
            run_dir: run_dir.to_path_buf(),
            cfg,
            tok,
            policy,
            critic,
            reference,
            actor_opt,
            critic_opt,
            engine,
            detector: CollapseDetector::new(),
            state,
            warm_start,
            masks,
            replay_buffer,
            pending_warnings: Vec::new(),
            rollout_worker: None,
            memory,
        })
    }

    /// Starts the rollout thread of `async_rollout` (nothing when it is off) with the batches
    /// `restored` from a checkpoint, and hands it the jobs the current version can serve.
    fn start_async(
        &mut self,
        restored: Vec<async_rollout::RolloutBatch>,
    ) -> Result<(), TrainError> {
        if !self.cfg.async_rollout.is_async() {
            return Ok(());
        }
        let worker = RolloutWorker::start(
            &self.cfg,
            &self.policy,
            &self.tok,
            self.state.step,
            restored,
        )?;
        self.rollout_worker = Some(worker);
        self.hand_out_rollouts()
    }

    /// Hands the rollout thread every job the current policy version serves (async only).
    fn hand_out_rollouts(&mut self) -> Result<(), TrainError> {
        let groups = self.cfg.train_env_manager.groups() as u64;
        match self.rollout_worker.as_mut() {
            Some(worker) => worker.hand_out(
                &self.policy,
                self.state.step,
                self.state.next_group_id,
                groups,
            ),
            None => Ok(()),
        }
    }

    /// The run's config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The counters (step, next group id, skipped updates) the run stands at.
    pub fn state(&self) -> &TrainState {
        &self.state
    }

    /// The current policy model.
    pub fn policy(&self) -> &Model {
        &self.policy
    }

    /// The directory the run writes its dataset, metrics and checkpoints to.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The policy weights by name, LoRA adapters included (for comparisons and tests).
    pub fn policy_weights(&self) -> Vec<(String, Tensor)> {
        let adapters = self.policy.adapters().map(|a| a.named_vars());
        self.policy
            .named_vars()
            .into_iter()
            .chain(adapters.into_iter().flatten())
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect()
    }

    /// The critic model's weights by name, LoRA adapters included (for comparisons and tests);
    /// empty without a critic model.
    pub fn critic_weights(&self) -> Vec<(String, Tensor)> {
        let vars = self.critic.as_ref().map_or_else(Vec::new, |c| c.weights());
        vars.into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect()
    }

    /// Trains until `until` steps are done (at most `max_steps`): validates at step 0 of a fresh
    /// run and every `eval_steps`, saves every `save_steps` and at `until`.
    pub fn run(&mut self, until: u64, on_event: &mut dyn FnMut(Event)) -> Result<(), TrainError> {
        let until = until.min(self.cfg.max_steps as u64);
        self.begin(on_event)?;
        while self.state.step < until {
            let scalars = self.train_step()?;
            self.after_step(&scalars, until, on_event)?;
        }
        Ok(())
    }

    /// The warm-start report and the step-0 validation of a fresh run (what [`Trainer::run`]
    /// does before its first step).
    pub fn begin(&mut self, on_event: &mut dyn FnMut(Event)) -> Result<(), TrainError> {
        self.report_warnings(on_event);
        if let Some(report) = self.warm_start.take() {
            let mut s = Scalars::new();
            s.insert("sft/loss_first".into(), report.first_loss);
            s.insert("sft/loss_final".into(), report.final_loss);
            s.insert("sft/env_errors".into(), report.env_errors.len() as f64);
            self.log(0, &s)?;
            if let Some(first) = report.env_errors.first() {
                on_event(Event::Warning(format!(
                    "warm start: {} env error(s) left their episodes out (on_error: skip); the first: {first}",
                    report.env_errors.len()
                )));
            }
            on_event(Event::WarmStart(&report));
        }
        if self.state.step == 0 && self.cfg.eval_steps > 0 {
            self.validate_and_log(on_event)?;
        }
        Ok(())
    }

    /// What follows a step: warnings, its metrics, then validation and a checkpoint when due
    /// (`until` is the last step of this run).
    pub fn after_step(
        &mut self,
        scalars: &Scalars,
        until: u64,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<(), TrainError> {
        self.report_warnings(on_event);
        for w in self.detector.observe(scalars) {
            on_event(Event::Warning(format!("step {}: {w}", self.state.step)));
        }
        for role in ["actor", "critic"] {
            let skipped = scalars
                .get(&format!("{role}/skipped_updates"))
                .copied()
                .unwrap_or(0.0);
            if skipped > 0.0 {
                on_event(Event::Warning(format!(
                    "step {}: {skipped} {role} update(s) skipped for a non-finite loss or \
                     gradient",
                    self.state.step
                )));
            }
        }
        self.log(self.state.step, scalars)?;
        crash::point("train.step_logged");
        on_event(Event::Step {
            step: self.state.step,
            scalars,
        });
        let step = self.state.step as usize;
        let last = self.state.step == until;
        if self.cfg.eval_steps > 0 && (step.is_multiple_of(self.cfg.eval_steps) || last) {
            self.validate_and_log(on_event)?;
        }
        let save = last || (self.cfg.save_steps > 0 && step.is_multiple_of(self.cfg.save_steps));
        if save {
            if let Some(dir) = self.checkpoint()? {
                on_event(Event::Checkpoint(&dir));
            }
        }
        Ok(())
    }

    /// Validates on rank 0 (the other ranks go on to the next rollout and wait for it there).
    fn validate_and_log(&mut self, on_event: &mut dyn FnMut(Event)) -> Result<(), TrainError> {
        if self.sink.is_none() {
            return Ok(());
        }
        let validation = self.validate()?;
        self.log(self.state.step, &validation.scalars)?;
        self.report_warnings(on_event);
        on_event(Event::Validation {
            step: self.state.step,
            summaries: &validation.summaries,
        });
        Ok(())
    }

    fn report_warnings(&mut self, on_event: &mut dyn FnMut(Event)) {
        for warning in self.pending_warnings.drain(..) {
            on_event(Event::Warning(warning));
        }
    }

    /// Queues a warning for env errors that dropped groups (`what`: the step or validation).
    fn warn_env_errors(&mut self, what: &str, errors: &[String]) {
        if let Some(first) = errors.first() {
            self.pending_warnings.push(format!(
                "{what}: {} env error(s) dropped their groups (on_error: skip); the first: {first}",
                errors.len()
            ));
        }
    }

    /// Writes metrics of `step` (rank 0; the other ranks keep none).
    fn log(&mut self, step: u64, scalars: &Scalars) -> Result<(), TrainError> {
        match self.sink.as_mut() {
            Some(sink) => Ok(sink.write(step, scalars)?),
            None => Ok(()),
        }
    }

    /// This process's rank and the number of ranks.
    pub fn world(&self) -> (usize, usize) {
        (self.dist.rank(), self.dist.size())
    }

    /// Runs validation with the current policy (held-out seeds).
    pub fn validate(&mut self) -> Result<Validation, TrainError> {
        let validation = eval::validate(&mut self.engine, &self.policy, &self.tok, &self.cfg)?;
        let what = format!("validation at step {}", self.state.step);
        self.warn_env_errors(&what, &validation.env_errors);
        Ok(validation)
    }

    /// One training step; returns its metrics.
    pub fn train_step(&mut self) -> Result<Scalars, TrainError> {
        if self.rollout_worker.is_some() {
            return self.train_step_async();
        }
        let t_step = self.start_step_clock();
        // Validation may have filled the cache under this version: start every rollout from the
        // same (empty) cache so a resumed run samples exactly what the original did.
        self.engine.flush()?;
        let rollout = eval::run_manager(
            &mut self.engine,
            &self.policy,
            &self.tok,
            &self.cfg,
            &self.cfg.train_env_manager,
            self.cfg.seed,
            self.state.next_group_id,
            &self.cfg.generating_args,
            (self.dist.rank(), self.dist.size()),
        )?;
        let t_rollout = t_step.elapsed().as_secs_f64();
        crash::point("train.rollout_done");
        let what = format!("step {}", self.state.step + 1);
        self.warn_env_errors(&what, &rollout.env_errors);
        let env_errors = ranks::sum_count(rollout.env_errors.len() as u64, self.dist.as_ref())?;
        let scores = eval::training_env_scores(&rollout, self.dist.as_ref())?;
        let mut scalars = self.learn(rollout.records, rollout.counters, t_step, t_rollout)?;
        scalars.extend(scores);
        scalars.insert("rollout/env_errors".into(), env_errors as f64);
        scalars.insert("time/rollout_env".into(), rollout.env_s);
        Ok(scalars)
    }

    /// One training step on the batch the rollout thread generated for it (`async_rollout`).
    fn train_step_async(&mut self) -> Result<Scalars, TrainError> {
        let t_step = self.start_step_clock();
        let worker = self.rollout_worker.as_mut().expect("async");
        let received = worker.take(self.state.step)?;
        let batch = received.batch;
        let what = format!("step {}", self.state.step + 1);
        self.warn_env_errors(&what, &batch.rollout.env_errors);
        let env_errors = batch.rollout.env_errors.len();
        let rollout = batch.rollout;
        let scores = eval::training_env_scores(&rollout, self.dist.as_ref())?;
        let mut scalars =
            self.learn(rollout.records, rollout.counters, t_step, batch.generate_s)?;
        scalars.extend(scores);
        scalars.insert("rollout/env_errors".into(), env_errors as f64);
        scalars.insert("time/rollout_env".into(), rollout.env_s);
        scalars.insert("time/trainer_wait".into(), received.trainer_wait_s);
        scalars.insert("time/rollout_wait".into(), batch.wait_s);
        let (rollout_busy, trainer_busy) =
            self.rollout_worker.as_ref().expect("async").busy_shares();
        scalars.insert("async/rollout_busy".into(), rollout_busy);
        scalars.insert("async/trainer_busy".into(), trainer_busy);
        Ok(scalars)
    }

    /// The start of a step: its wall clock, and a new window of the device's memory peak
    /// (`memory/peak_gib` at the step's end).
    fn start_step_clock(&self) -> Instant {
        crate::device::reset_memory_peak(self.policy.device());
        Instant::now()
    }

    /// The engine, policy and tokenizer that generate (an outside rollout source, such as the
    /// gateway, generates with them between updates).
    pub fn generation_parts(&mut self) -> (&mut Engine, &Model, &Tokenizer) {
        (&mut self.engine, &self.policy, &self.tok)
    }

    /// The answer grammar of every env tag the update scores under (empty without constrained
    /// decoding): an outside rollout source samples a tag's responses under the same grammar.
    pub fn answer_grammars(&self) -> BTreeMap<String, Arc<ResponseGrammar>> {
        self.masks.grammars()
    }

    /// Id of the first group of the next rollout (trajectory ids are `group_id · group_size +
    /// member`).
    pub fn next_group_id(&self) -> u64 {
        self.state.next_group_id
    }

    /// The rest of a step once its rollout is done (`local`: this rank's records, ids from
    /// [`Trainer::next_group_id`] on; `counters`: the engine's during the rollout; `t_step`: when
    /// the step began, `t_rollout`: seconds the rollout took): store, advantages, update, next
    /// policy version. Returns the step's metrics.
    pub fn learn(
        &mut self,
        local: Vec<StepRecord>,
        counters: CacheCounters,
        t_step: Instant,
        t_rollout: f64,
    ) -> Result<Scalars, TrainError> {
        let traffic = self.dist.traffic();
        let mut scalars = Scalars::new();
        self.store(&local)?;
        let records = ranks::gather_records(local, self.dist.as_ref())?;
        let counters = ranks::sum_counters(counters, self.dist.as_ref())?;
        self.state.next_group_id += self.cfg.train_env_manager.groups() as u64;
        eval::env_metrics("env", &records, &mut scalars);
        staleness_metrics(&records, self.state.step, &mut scalars);
        rollout_metrics(
            &records,
            &counters,
            self.cfg.generating_args.max_new_tokens,
            &mut scalars,
        );

        let t_adv = Instant::now();
        let filter = uncertainty_filter(&records, &self.cfg.filter_config());
        scalars.extend(filter.metrics.clone());
        let sequences = context_sequences(&records);
        let target = self.cfg.adv_estimator.critic_target();
        let old_values = match target {
            Some(t) => self.critic_values(&records, &sequences, t)?,
            None => Vec::new(),
        };
        let correction = self.proximal_correction(&records, &sequences, &mut scalars)?;
        let reference_logprobs = self.reference_logprobs(&records, &sequences)?;
        let kl_penalty = self.kl_penalty(
            &records,
            correction.as_ref().map(|c| c.logprobs.as_slice()),
            reference_logprobs.as_deref(),
            &mut scalars,
        )?;
        let advantages = self.advantages(
            &records,
            &old_values,
            target,
            kl_penalty.as_deref(),
            &mut scalars,
        )?;
        let step_advantages: Vec<f32> = advantages.0.iter().map(|a| mean(a)).collect();
        self.admit_to_replay(&records, &mut scalars)?;
        let (actor_advantages, proximal_logprobs) = match correction {
            Some(c) => (c.weighted_advantages(&advantages.0), Some(c.logprobs)),
            None => (advantages.0, None),
        };
        let time_adv = t_adv.elapsed().as_secs_f64();

        let t_update = Instant::now();
        // Out of `self` while the update (which borrows `self` mutably) replays it.
        let buffer = self.replay_buffer.take();
        let critic_keep = if self.cfg.critic.train_on_filtered {
            vec![true; records.len()]
        } else {
            filter.keep.clone()
        };
        let inputs = UpdateInputs {
            records: &records,
            sequences,
            actor_keep: filter.keep,
            critic_keep,
            advantages: actor_advantages,
            returns: advantages.1,
            old_values,
            critic_target: target,
            ref_logprobs: reference_logprobs.filter(|_| self.cfg.use_kl_loss),
            replay: buffer.as_ref().map(|buffer| Replay {
                records: buffer.records(),
                spans: buffer.spans(),
                coef: self.cfg.self_imitation.coef,
                batch_size: self.cfg.self_imitation.batch_size,
                seed: seed::derive(self.cfg.seed, &[SEED_REPLAY, self.state.step]),
            }),
            proximal_logprobs,
        };
        let report = self.update(&inputs);
        let credit = report.as_ref().ok().map(|report| {
            let used = UsedCredit {
                advantages: &step_advantages,
                ratios: &report.ratios,
                learner_version: self.state.step,
            };
            credit_rows(&inputs, &used)
        });
        drop(inputs);
        self.replay_buffer = buffer;
        let update_scalars = report?.scalars;
        if let (Some(log), Some(rows)) = (self.credit_log.as_mut(), credit) {
            log.append(&rows)?;
        }
        self.state.skipped_updates += ["actor/skipped_updates", "critic/skipped_updates"]
            .iter()
            .filter_map(|k| update_scalars.get(*k))
            .sum::<f64>() as u64;
        scalars.extend(update_scalars);
        let time_update = t_update.elapsed().as_secs_f64();

        self.state.step += 1;
        self.policy.refresh_rollout_weights()?;
        self.engine.set_policy_version(self.state.step)?;
        self.hand_out_rollouts()?;
        let time_step = t_step.elapsed().as_secs_f64();
        let tokens: usize = records
            .iter()
            .map(|r| r.obs_ids.len() + r.response_ids.len())
            .sum();
        scalars.insert("time/rollout".into(), t_rollout);
        scalars.insert("time/advantage".into(), time_adv);
        scalars.insert("time/update".into(), time_update);
        scalars.insert("time/step".into(), time_step);
        if !self.dist.is_single_process() {
            let now = self.dist.traffic();
            scalars.insert("dist/ranks".into(), self.dist.size() as f64);
            scalars.insert("dist/bytes".into(), (now.bytes - traffic.bytes) as f64);
            let ring = now.ring_bytes - traffic.ring_bytes;
            scalars.insert("dist/ring_bytes".into(), ring as f64);
            scalars.insert("dist/seconds".into(), now.seconds - traffic.seconds);
        }
        scalars.insert(
            "throughput/tokens_per_s".into(),
            tokens as f64 / time_step.max(1e-9),
        );
        if let Some(peak) = crate::device::memory_peak(self.policy.device()) {
            scalars.insert("memory/peak_gib".into(), peak as f64 / GIB);
        }
        if let Some(planned) = self.memory.as_ref().and_then(|m| m.take_largest_planned()) {
            scalars.insert("memory/planned_peak_gib".into(), planned as f64 / GIB);
        }
        Ok(scalars)
    }

    /// Appends this rank's records to its segments; in a launched world the lead then lists every
    /// rank's segments in the manifest, so the dataset and the lead's position cover them all.
    fn store(&mut self, records: &[StepRecord]) -> Result<(), TrainError> {
        for (i, r) in records.iter().enumerate() {
            if i == records.len() / 2 {
                crash::point_after("train.store_write", || self.dataset.flush());
            }
            self.dataset.append(r)?;
        }
        self.dataset.flush()?;
        if self.dist.is_single_process() {
            return Ok(());
        }
        let own = match self.dataset.shard() {
            Some(_) => self.dataset.position()?.segments,
            None => Vec::new(),
        };
        let bytes = serde_json::to_vec(&own).map_err(|e| TrainError::Data(e.to_string()))?;
        let gathered = self.dist.all_gather_bytes(&bytes)?;
        if self.dataset.shard().is_none() {
            let mut entries = Vec::new();
            for (rank, part) in gathered.iter().enumerate().skip(1) {
                let listed: Vec<SegmentEntry> = serde_json::from_slice(part).map_err(|e| {
                    TrainError::Data(format!("segments reported by rank {rank}: {e}"))
                })?;
                entries.extend(listed);
            }
            self.dataset.record_shards(entries)?;
        }
        Ok(())
    }

    /// Sends the rollout's better choices to the self-imitation buffer (when there is one).
    fn admit_to_replay(
        &mut self,
        records: &[StepRecord],
        scalars: &mut Scalars,
    ) -> Result<(), TrainError> {
        let Some(buffer) = self.replay_buffer.as_mut() else {
            return Ok(());
        };
        let returns = step_returns(records, f64::from(self.cfg.step_reward_gamma))?;
        let added = buffer.admit(records, &returns, self.cfg.self_imitation.margin);
        scalars.insert("self_imitation/added".into(), added as f64);
        scalars.insert(
            "self_imitation/buffer_size".into(),
            buffer.spans().len() as f64,
        );
        Ok(())
    }

    /// Rollout-time critic values of every record (each rank computes its share of the
    /// sequences).
    fn critic_values(
        &self,
        records: &[StepRecord],
        sequences: &[Vec<usize>],
        target: CriticTarget,
    ) -> Result<Vec<Vec<f32>>, TrainError> {
        let reading = ValueReading {
            policy: &self.policy,
            records,
            sequences,
            target,
            chunks: (VALUE_CHUNK, self.layout()),
            masks: &self.masks,
            dist: self.dist.as_ref(),
        };
        match &self.critic {
            Some(critic) => critic.record_values(&reading),
            None => Err(TrainError::Data(
                "the estimator reads critic values, and the run has no critic".into(),
            )),
        }
    }

    /// Decoupled PPO's correction of a batch whose behaviour log-probs are not the update's
    /// own: responses of older policy versions (`async_rollout`), or any response when the
    /// rollout computes in other numerics than the update (bf16 in either: `precision`,
    /// `rollout_dtype`). The current policy's log-probs in the update's numerics (the proximal
    /// policy's) and the truncated behaviour weights; `None` when the stored log-probs are the
    /// update's own or the ratio is to be taken against them (`proximal: behaviour`).
    fn proximal_correction(
        &self,
        records: &[StepRecord],
        sequences: &[Vec<usize>],
        scalars: &mut Scalars,
    ) -> Result<Option<ProximalCorrection>, TrainError> {
        let stale = records.iter().any(|r| r.policy_version != self.state.step);
        let numerics_differ = self.cfg.precision != Precision::F32
            || self.policy.rollout_precision() != Precision::F32;
        let decoupled = self.cfg.async_rollout.proximal == ProximalPolicy::Recompute;
        if !decoupled || !(stale && self.cfg.async_rollout.is_async() || numerics_differ) {
            return Ok(None);
        }
        let t = Instant::now();
        let proximal = self.logprobs_under(&self.policy, records, sequences)?;
        let behaviour: Vec<Vec<f32>> = records
            .iter()
            .map(|r| r.response_logprobs.clone())
            .collect();
        let cap = self.cfg.async_rollout.behaviour_weight_cap;
        let correction = ProximalCorrection::new(proximal, &behaviour, cap);
        let stats = correction.stats(cap);
        scalars.insert("actor/behaviour_weight_mean".into(), stats.mean);
        scalars.insert("actor/behaviour_weight_max".into(), stats.max);
        scalars.insert("actor/behaviour_weight_truncated".into(), stats.truncated);
        scalars.insert("time/proximal".into(), t.elapsed().as_secs_f64());
        Ok(Some(correction))
    }

    /// The layout of every training-path forward (`tree_forward`).
    fn layout(&self) -> BatchLayout {
        BatchLayout {
            pad_id: self.tok.pad_id(),
            tree: self.cfg.tree_forward,
        }
    }

    /// The reference policy's log-prob of every response token; `None` without a reference.
    fn reference_logprobs(
        &self,
        records: &[StepRecord],
        sequences: &[Vec<usize>],
    ) -> Result<Option<Vec<Vec<f32>>>, TrainError> {
        let Some(reference) = &self.reference else {
            return Ok(None);
        };
        Ok(Some(self.logprobs_under(reference, records, sequences)?))
    }

    /// `model`'s log-prob of every response token, as the update scores them (each rank
    /// computes its share of the sequences).
    fn logprobs_under(
        &self,
        model: &Model,
        records: &[StepRecord],
        sequences: &[Vec<usize>],
    ) -> Result<Vec<Vec<f32>>, TrainError> {
        ranks::per_record_rows(records.len(), sequences, self.dist.as_ref(), |mine| {
            response_logprobs(
                model,
                records,
                mine,
                (VALUE_CHUNK, self.layout()),
                self.update_temperature(),
                &self.masks,
            )
        })
    }

    /// The KL-in-reward penalty of every response token, `init_kl_coef · KL(π_θ ‖ π_ref)`
    /// (ROLL `init_kl_coef` / `kl_penalty`), `None` when it is off. π_θ's log-probs are the
    /// proximal ones when the update recomputed them in its own numerics (`policy_logprobs`; the
    /// reference is scored in the same numerics, as verl scores its recomputed old log-probs),
    /// else the sampler's.
    fn kl_penalty(
        &self,
        records: &[StepRecord],
        policy_logprobs: Option<&[Vec<f32>]>,
        reference_logprobs: Option<&[Vec<f32>]>,
        scalars: &mut Scalars,
    ) -> Result<Option<Vec<Vec<f32>>>, TrainError> {
        let Some(reference_logprobs) = reference_logprobs.filter(|_| self.cfg.init_kl_coef > 0.0)
        else {
            return Ok(None);
        };
        let sampled: Vec<Vec<f32>>;
        let rollout_logprobs = match policy_logprobs {
            Some(p) => p,
            None => {
                sampled = records
                    .iter()
                    .map(|r| r.response_logprobs.clone())
                    .collect();
                &sampled
            }
        };
        let coef = self.cfg.init_kl_coef;
        let penalty = kl_reward_penalty(
            rollout_logprobs,
            reference_logprobs,
            coef,
            self.cfg.kl_penalty,
        )?;
        let tokens = penalty.iter().map(Vec::len).sum::<usize>().max(1);
        let total: f64 = penalty.iter().flatten().map(|&p| f64::from(p)).sum();
        scalars.insert(
            "actor/reward_kl_penalty".into(),
            total / f64::from(coef) / tokens as f64,
        );
        scalars.insert("actor/reward_kl_penalty_coeff".into(), f64::from(coef));
        Ok(Some(penalty))
    }

    /// Per-token advantages and returns of every record.
    #[allow(clippy::type_complexity)]
    fn advantages(
        &self,
        records: &[StepRecord],
        values: &[Vec<f32>],
        target: Option<CriticTarget>,
        kl_penalty: Option<&[Vec<f32>]>,
        scalars: &mut Scalars,
    ) -> Result<(Vec<Vec<f32>>, Vec<Vec<f32>>), TrainError> {
        let step_values: Vec<f32>;
        let mut inputs = AdvantageInputs {
            token_reward_penalty: kl_penalty,
            ..AdvantageInputs::default()
        };
        match target {
            Some(CriticTarget::StepStart) => {
                step_values = values
                    .iter()
                    .map(|v| v.first().copied().unwrap_or(0.0))
                    .collect();
                inputs.values = Some(&step_values);
            }
            Some(CriticTarget::AllResponseTokens) => inputs.token_values = Some(values),
            None => {}
        }
        let out = compute_advantages(records, &inputs, &self.cfg.advantage_config())?;
        for (k, v) in &out.metrics {
            scalars.insert(critic_metric_name(k), *v);
        }
        if target.is_some() {
            self.value_fit_metrics(records, values, scalars)?;
        }
        Ok((out.token_advantages(records), out.token_returns(records)))
    }

    /// `critic/vf_explained_var`: the rollout-time step-start values against the Monte-Carlo
    /// step returns (γ = `gamma`) over the whole batch, next to the tabular ceiling
    /// (`critic/vf_explained_var_ceiling`, over `critic/vf_ceiling_coverage` of the rows). Also
    /// the batch's return variance and residual variance (`critic/return_var`,
    /// `critic/vf_residual_var`) and its step rows (`critic/rows`), from which the explained
    /// variance pooled over many steps follows: 1 − Σ rows · residual / Σ rows · return. A
    /// mean of per-step figures is dominated by the batches whose returns barely vary (a policy
    /// that solves nearly every map), where one miss makes the figure hugely negative.
    fn value_fit_metrics(
        &self,
        records: &[StepRecord],
        values: &[Vec<f32>],
        out: &mut Scalars,
    ) -> Result<(), TrainError> {
        let returns = step_returns(records, f64::from(self.cfg.gamma))?;
        let starts: Vec<f64> = values
            .iter()
            .map(|v| f64::from(v.first().copied().unwrap_or(0.0)))
            .collect();
        let parts = VarianceParts::of(&starts, &returns);
        out.insert("critic/vf_explained_var".into(), parts.explained());
        out.insert("critic/return_var".into(), parts.returns);
        out.insert("critic/vf_residual_var".into(), parts.residual);
        out.insert("critic/rows".into(), returns.len() as f64);
        if let Some(c) = tabular_ceiling(records, &returns) {
            out.insert("critic/vf_explained_var_ceiling".into(), c.explained_var);
            out.insert("critic/vf_ceiling_coverage".into(), c.coverage);
        }
        Ok(())
    }

    fn update(&mut self, inputs: &UpdateInputs) -> Result<UpdateReport, TrainError> {
        let opt = self.cfg.optimizer_config();
        let total = self.cfg.max_steps;
        let update_index = self.state.step as usize;
        let loss = self.cfg.loss_config();
        let temperature = self.update_temperature();
        let settings = UpdateSettings {
            loss: &loss,
            epochs: self.cfg.ppo_epochs,
            critic_epochs: self.cfg.critic.epochs(self.cfg.ppo_epochs),
            mini_batch: self.cfg.ppo_mini_batch_size,
            actor_lr: LrSchedule::actor(&opt, total).lr_at(update_index),
            critic_lr: LrSchedule::critic(&opt, total).lr_at(update_index),
            max_grad_norm: self.cfg.max_grad_norm as f64,
            temperature,
            pad_id: self.tok.pad_id(),
            shuffle_seed: seed::derive(self.cfg.seed, &[SEED_SHUFFLE, self.state.step]),
            masks: &self.masks,
            freeze_actor: update_index < self.cfg.critic.warmup_steps,
            dist: self.dist.as_ref(),
            tree_forward: self.cfg.tree_forward,
            memory: self.memory.as_ref(),
        };
        let critic = self
            .critic
            .as_deref_mut()
            .zip(self.critic_opt.as_mut())
            .map(|(critic, opt)| CriticLearner { critic, opt });
        let mut learners = Learners {
            policy: &self.policy,
            actor_opt: &mut self.actor_opt,
            critic,
        };
        update::ppo_update(inputs, &settings, &mut learners)
    }

    /// The temperature the rollout sampled at: the update's (and the reference's) log-probs
    /// are computed under it.
    fn update_temperature(&self) -> f32 {
        if self.cfg.generating_args.do_sample {
            self.cfg.generating_args.temperature
        } else {
            1.0
        }
    }

    /// Writes `ckpt-<step>` and returns it on rank 0: rank 0 starts it; with sharded optimizers
    /// every rank then writes its blocks of their states into it (a collective); rank 0 writes
    /// the rest and commits it ([`Trainer::save_checkpoint`]).
    fn checkpoint(&mut self) -> Result<Option<PathBuf>, TrainError> {
        let step = self.state.step;
        let writer = self
            .sink
            .is_some()
            .then(|| CheckpointWriter::begin(&self.run_dir, step).map_err(TrainError::from));
        let optimizers = [
            (Some(&self.actor_opt), ACTOR_OPTIMIZER),
            (self.critic_opt.as_ref(), CRITIC_OPTIMIZER),
        ];
        let sharded: Vec<(&AdamW, &str)> = optimizers
            .into_iter()
            .filter_map(|(opt, name)| opt.filter(|o| o.shard().is_some()).map(|o| (o, name)))
            .collect();
        if !sharded.is_empty() {
            let dist = self.dist.as_ref();
            let begun = match &writer {
                Some(Err(e)) => Err(TrainError::Data(e.to_string())),
                _ => Ok(()),
            };
            agree(dist, begun, "starting the checkpoint")?;
            let tmp = CheckpointWriter::tmp_path(&self.run_dir, step);
            let written = sharded
                .iter()
                .try_for_each(|(opt, name)| Ok(opt.save_block(&tmp.join(name))?));
            agree(dist, written, "writing the optimizers' blocks")?;
        }
        match writer {
            Some(writer) => Ok(Some(self.save_checkpoint(writer?)?)),
            None => Ok(None),
        }
    }

    /// Writes the checkpoint `writer` began (never from non-finite weights) and points
    /// `ckpt-latest` at it; an unsharded optimizer's whole state goes in with it (a sharded one's
    /// blocks are in it already). Rank 0's work: the other ranks hold the same weights and write
    /// nothing.
    fn save_checkpoint(&mut self, writer: CheckpointWriter) -> Result<PathBuf, TrainError> {
        let (Some(sink), Some(credit_log)) = (self.sink.as_mut(), self.credit_log.as_mut()) else {
            return Err(TrainError::Data("only rank 0 writes checkpoints".into()));
        };
        let position = RunPosition::capture(&self.run_dir, &mut self.dataset, sink, credit_log)?;
        let policy_vars = self.policy.named_vars();
        writer.ensure_finite(policy_vars.iter().map(|(n, v)| (n.as_str(), v.as_tensor())))?;
        let tmp = writer.tmp_dir().to_path_buf();
        self.policy.save(&tmp.join("policy"), Some(&self.tok))?;
        crash::point("checkpoint.partial");
        save_whole_optimizer(&self.actor_opt, &tmp, ACTOR_OPTIMIZER)?;
        if let Some(critic) = &self.critic {
            let vars = critic.weights();
            writer.ensure_finite(vars.iter().map(|(n, v)| (n.as_str(), v.as_tensor())))?;
            critic.save(&tmp)?;
        }
        if let Some(opt) = &self.critic_opt {
            save_whole_optimizer(opt, &tmp, CRITIC_OPTIMIZER)?;
        }
        if let Some(buffer) = &self.replay_buffer {
            buffer.save(&tmp.join(self_imitation::CHECKPOINT_DIR))?;
        }
        if let Some(worker) = self.rollout_worker.as_mut() {
            async_rollout::save_pending(&tmp.join(async_rollout::PENDING_DIR), worker.pending()?)?;
        }
        writer.json("state", &self.state)?;
        writer.json("config", &self.cfg)?;
        writer.json(run_dir::POSITION_FILE, &position)?;
        let dir = writer.commit()?;
        crash::point("checkpoint.committed");
        Ok(dir)
    }
}

/// What the update used for each record, beyond the update's inputs: the estimator's advantage
/// before any behaviour correction (mean over the step's tokens), the ratios the policy loss saw,
/// and the version being trained.
struct UsedCredit<'a> {
    advantages: &'a [f32],
    ratios: &'a StepRatios,
    learner_version: u64,
}

/// The credit log's row of every record of an update.
fn credit_rows(inputs: &UpdateInputs, used: &UsedCredit) -> Vec<StepCredit> {
    inputs
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| StepCredit {
            traj_id: r.traj_id,
            step_index: r.step_index,
            learner_version: used.learner_version,
            behaviour_version: r.policy_version,
            kept: inputs.actor_keep[i],
            value: inputs.old_values.get(i).and_then(|v| v.first().copied()),
            ret: inputs.returns[i].first().copied().unwrap_or(0.0),
            advantage: used.advantages[i],
            ratio_first: used.ratios.first(i),
            ratio_last: used.ratios.last(i),
        })
        .collect()
}

fn mean(values: &[f32]) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    values.iter().sum::<f32>() / values.len() as f32
}

/// This rank's writer of the run's dataset, made by `open` (`DatasetWriter::create` or
/// `open_append`): rank 0's keeps the manifest, rank r's writes shard r's segments once rank 0's
/// exists.
fn rank_writer(
    cfg: &Config,
    run_dir: &Path,
    dist: &dyn Collective,
    open: fn(&Path, WriterOptions) -> Result<DatasetWriter, crate::store::StoreError>,
) -> Result<DatasetWriter, TrainError> {
    let dir = run_dir.join(run_dir::DATASET_DIR);
    let lead = match dist.rank() {
        0 => Some(open(&dir, writer_options(cfg))?),
        _ => None,
    };
    dist.barrier()?;
    Ok(match lead {
        Some(writer) => writer,
        None => open(
            &dir,
            WriterOptions {
                shard: Some(dist.rank() as u32),
                ..writer_options(cfg)
            },
        )?,
    })
}

/// A fresh run refuses a critic its estimator never reads: it would be built (and for `state`,
/// demand critic facts from every env) and then ignored. Checked when a run starts rather than in
/// the config's validation, so runs saved with such a config still resume.
fn check_critic_is_read(cfg: &Config) -> Result<(), TrainError> {
    if cfg.critic.mode == CriticMode::None || cfg.adv_estimator.needs_critic() {
        return Ok(());
    }
    Err(TrainError::Data(format!(
        "critic.mode: {} is set, but adv_estimator {} reads no critic; set critic.mode: none \
         (or choose step_gae / token_gae)",
        config_name(&cfg.critic.mode),
        config_name(&cfg.adv_estimator)
    )))
}

/// Refuses what several ranks cannot compute as one process would: a loss normalised by the
/// mask width of each rank's part.
fn check_world(cfg: &Config, dist: &dyn Collective) -> Result<(), TrainError> {
    let ranks = dist.size();
    if ranks > 1 && cfg.async_rollout.is_async() {
        return Err(TrainError::Data(format!(
            "async_rollout.staleness: {} runs generation in a thread of one process; set it to \
             0 to train on {ranks} ranks",
            cfg.async_rollout.staleness
        )));
    }
    check_sharding(cfg.sharding, dist.is_single_process())?;
    let sum_norm = cfg.loss_agg_mode == LossAggMode::SeqMeanTokenSumNorm;
    if ranks > 1 && sum_norm {
        return Err(TrainError::Data(format!(
            "loss_agg_mode: seq-mean-token-sum-norm divides by the mask width, which differs \
             between the {ranks} ranks' parts of a mini-batch: choose another mode to train on \
             several ranks"
        )));
    }
    Ok(())
}

/// The checkpoint names of the actor's and the critic's optimizer states: `<name>.safetensors`
/// (a whole state) or `<name>/` (the ranks' blocks of a sharded one).
const ACTOR_OPTIMIZER: &str = "optim_actor";
const CRITIC_OPTIMIZER: &str = "optim_critic";

/// Writes an unsharded optimizer's whole state into checkpoint directory `tmp` as `name`; of a
/// sharded one, checks that every rank's block is there.
fn save_whole_optimizer(opt: &AdamW, tmp: &Path, name: &str) -> Result<(), TrainError> {
    match opt.shard() {
        None => opt.save(&tmp.join(format!("{name}.safetensors")))?,
        Some(_) => AdamW::check_blocks(&tmp.join(name))?,
    }
    Ok(())
}

/// Where checkpoint `ckpt` keeps optimizer `name`'s state: the ranks' blocks of a sharded run,
/// else the whole-state file.
fn optimizer_state(ckpt: &Path, name: &str) -> PathBuf {
    let blocks = ckpt.join(name);
    match blocks.is_dir() {
        true => blocks,
        false => ckpt.join(format!("{name}.safetensors")),
    }
}

/// `mine` once every rank has said how its part of a collective save went: this rank's error,
/// or an error naming `what` when another rank failed.
fn agree<T>(
    dist: &dyn Collective,
    mine: Result<T, TrainError>,
    what: &str,
) -> Result<T, TrainError> {
    let mut failed = [f64::from(u8::from(mine.is_err()))];
    dist.all_reduce_f64(&mut failed)?;
    match mine {
        Ok(_) if failed[0] > 0.0 => Err(TrainError::Data(format!(
            "{what} failed on another rank (its error is in its output)"
        ))),
        other => other,
    }
}

/// Refuses a `sharding` mode that cannot apply: any but `none` in a process on its own (a
/// launched world of one rank runs it, its one block the whole state, which exercises the
/// collectives' backend).
fn check_sharding(sharding: Sharding, single_process: bool) -> Result<(), TrainError> {
    let mode = sharding.name();
    if sharding == Sharding::Parameters {
        return Err(TrainError::Data(
            "sharding: `parameters` (ZeRO-3, weights partitioned and gathered layer by layer) is \
             not available yet; `gradients` (ZeRO-2) partitions the moments and the gradients"
                .into(),
        ));
    }
    if sharding != Sharding::None && single_process {
        return Err(TrainError::Data(format!(
            "sharding: `{mode}` partitions state across ranks, and this run is one process: set \
             sharding=none, or launch several ranks (mpirun -np N stepppo train …)"
        )));
    }
    Ok(())
}

/// Gives every rank rank 0's values of `vars` (the warm-started weights).
fn broadcast_weights(dist: &dyn Collective, vars: &[(String, Var)]) -> Result<(), TrainError> {
    if dist.is_single_process() {
        return Ok(());
    }
    for (_, var) in vars {
        let host = var
            .as_tensor()
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut bytes: Vec<u8> = host.iter().flat_map(|x| x.to_le_bytes()).collect();
        dist.broadcast_bytes(&mut bytes)?;
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let t = Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
        var.set(&t)?;
    }
    Ok(())
}

/// Sets `activation_checkpointing` and `precision` in the policy and a separate critic, and
/// `rollout_dtype` in the policy.
fn set_numerics(
    cfg: &Config,
    policy: &mut Model,
    critic: Option<&mut Box<dyn Critic>>,
) -> Result<(), TrainError> {
    policy.set_activation_checkpointing(cfg.activation_checkpointing);
    policy.set_precision(cfg.precision);
    if let Some(rollout) = cfg.rollout_dtype {
        policy.set_rollout_precision(rollout)?;
    }
    if let Some(c) = critic {
        c.set_numerics(cfg);
    }
    Ok(())
}

/// Stops a run whose memory plan (weights, optimizer, KV pool, the smallest mini-batch) does
/// not fit in the machine's memory, with the plan's table, before anything large is allocated;
/// planned for one of `ranks` ranks.
fn check_memory(
    cfg: &Config,
    policy: &Model,
    lora: Option<LoraSpec>,
    ranks: usize,
) -> Result<(), TrainError> {
    match MemoryBudget::for_run(cfg, policy.config(), lora, (policy.device(), ranks)) {
        Some(budget) => budget.check_start().map_err(TrainError::Memory),
        None => Ok(()),
    }
}

/// The optimizers of a run: the actor's over the policy's parameters less a shared value head
/// (`optimizer_config`), and the critic's over the separate critic or the shared head, at the
/// critic's own learning rate and weight decay (`critic_optimizer_config`); sharded over
/// `dist`'s ranks as `sharding` says (a value-MLP critic's excepted).
fn optimizers(
    cfg: &Config,
    policy: &Model,
    critic: Option<&dyn Critic>,
    dist: &dyn Collective,
) -> Result<(AdamW, Option<AdamW>), TrainError> {
    let trunk: Vec<_> = policy
        .trainable_vars()
        .into_iter()
        .filter(|(name, _)| !name.starts_with(crate::model::critic::VALUE_HEAD_PREFIX))
        .collect();
    let world = (dist.rank(), dist.size());
    let actor_opt = AdamW::sharded(trunk, &cfg.optimizer_config(), cfg.sharding, world)?;
    let critic_opt = critic
        .map(|c| {
            // A value MLP is fitted alike on every rank, on the same rows, without collectives:
            // its optimizer stays whole.
            let sharding = match c.trains_on_mini_batches() {
                true => cfg.sharding,
                false => Sharding::None,
            };
            let params = c.trainable_vars(policy);
            AdamW::sharded(params, &cfg.critic_optimizer_config(), sharding, world)
        })
        .transpose()?;
    Ok((actor_opt, critic_opt))
}

/// Brings the run's dataset and metrics back to the position `ckpt` recorded; returns the
/// warnings to report (what was removed, or that an older checkpoint recorded no position).
fn rewind_to(run_dir: &Path, ckpt: &Path) -> Result<Vec<String>, TrainError> {
    let name = ckpt.file_name().unwrap_or_default().to_string_lossy();
    if !ckpt
        .join(format!("{}.json", run_dir::POSITION_FILE))
        .is_file()
    {
        return Ok(vec![format!(
            "{name} records no dataset position (written by an older stepppo): records and \
             metric rows written after it are kept and may repeat"
        )]);
    }
    let position: RunPosition = checkpoint::load_json(ckpt, run_dir::POSITION_FILE)?;
    let rewound = run_dir::rewind(run_dir, &position)?;
    if rewound == Rewound::default() {
        return Ok(Vec::new());
    }
    Ok(vec![format!(
        "resuming from {name}: removed {} step records and {} metric rows written after it",
        rewound.records, rewound.metric_rows
    )])
}

/// The algo estimators' `reward|advantage|return|value/{mean,min,max}` under ROLL/verl's
/// `critic/{rewards,advantages,returns,values}/…`; other names unchanged.
fn critic_metric_name(name: &str) -> String {
    let renames = [
        ("reward/", "critic/rewards/"),
        ("advantage/", "critic/advantages/"),
        ("return/", "critic/returns/"),
        ("value/", "critic/values/"),
    ];
    for (from, to) in renames {
        if let Some(stat) = name.strip_prefix(from) {
            if matches!(stat, "mean" | "min" | "max") {
                return format!("{to}{stat}");
            }
        }
    }
    name.to_string()
}

/// Rollout-side metrics: in-group reward std, prefix reuse, response lengths.
/// `rollout/staleness_mean` and `_max`: how many policy versions the batch's responses lag
/// `version`, the version that trains on them (0 in a synchronous run).
fn staleness_metrics(records: &[StepRecord], version: u64, out: &mut Scalars) {
    if records.is_empty() {
        return;
    }
    let lags: Vec<f64> = records
        .iter()
        .map(|r| version.saturating_sub(r.policy_version) as f64)
        .collect();
    let mean = lags.iter().sum::<f64>() / lags.len() as f64;
    out.insert("rollout/staleness_mean".into(), mean);
    out.insert(
        "rollout/staleness_max".into(),
        lags.iter().copied().fold(0.0, f64::max),
    );
}

fn rollout_metrics(
    records: &[StepRecord],
    counters: &crate::rollout::engine::CacheCounters,
    max_new_tokens: usize,
    out: &mut Scalars,
) {
    let stds: Vec<f64> = group_reward_std(records).into_values().collect();
    if !stds.is_empty() {
        let n = stds.len() as f64;
        out.insert(
            "rollout/in_group_reward_std".into(),
            stds.iter().sum::<f64>() / n,
        );
        out.insert(
            "rollout/in_group_reward_std_min".into(),
            stds.iter().copied().fold(f64::INFINITY, f64::min),
        );
        out.insert(
            "rollout/in_group_reward_std_max".into(),
            stds.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
    }
    out.insert("rollout/prefix_hit_ratio".into(), counters.hit_ratio());
    out.insert(
        "rollout/prompt_tokens".into(),
        counters.prompt_tokens as f64,
    );
    out.insert(
        "rollout/prefilled_tokens".into(),
        counters.tokens_prefilled as f64,
    );
    out.insert(
        "rollout/cached_tokens".into(),
        counters.tokens_from_cache as f64,
    );
    out.insert(
        "rollout/generated_tokens".into(),
        counters.decode_tokens as f64,
    );
    out.insert(
        "rollout/cascade_forwards".into(),
        counters.cascade_forwards as f64,
    );
    out.insert(
        "rollout/shared_positions_saved".into(),
        counters.shared_positions_saved as f64,
    );
    let lens: Vec<usize> = records.iter().map(|r| r.response_ids.len()).collect();
    if !lens.is_empty() {
        let n = lens.len() as f64;
        out.insert(
            "response_length/mean".into(),
            lens.iter().sum::<usize>() as f64 / n,
        );
        out.insert(
            "response_length/max".into(),
            *lens.iter().max().unwrap() as f64,
        );
        out.insert(
            "response_length/clip_ratio".into(),
            lens.iter().filter(|&&l| l >= max_new_tokens).count() as f64 / n,
        );
    }
    let trajs: BTreeMap<u64, ()> = records.iter().map(|r| (r.traj_id, ())).collect();
    out.insert("rollout/trajectories".into(), trajs.len() as f64);
    out.insert("rollout/steps".into(), records.len() as f64);
}

/// The run's reference policy, written when the run was created.
fn load_reference(run_dir: &Path, device: &Device) -> Result<Model, TrainError> {
    let dir = run_dir.join(run_dir::REFERENCE_DIR);
    let (reference, _) = crate::model::checkpoint::load_policy(&dir.display().to_string(), device)?;
    Ok(reference)
}

fn writer_options(cfg: &Config) -> WriterOptions {
    let mut opts = WriterOptions::default();
    opts.metadata.insert(
        "exp_name".into(),
        serde_json::Value::String(cfg.exp_name.clone()),
    );
    opts.metadata.insert(
        "custom_envs".into(),
        serde_json::to_value(&cfg.custom_envs).expect("env configs serialise"),
    );
    opts
}

/// The supervised warm start of a fresh run: behaviour cloning of `sft.agent` transcripts, with
/// the critic warm-up on the same transcripts when `sft.value_loss_coef > 0`.
fn warm_start(
    cfg: &Config,
    policy: &Model,
    critic: Option<&CriticTrunk>,
    tok: &Tokenizer,
) -> Result<SftReport, TrainError> {
    let kind: AgentKind = cfg
        .sft
        .agent
        .parse()
        .map_err(|e: String| TrainError::Data(format!("sft.agent: {e}")))?;
    let base = seed::derive(cfg.seed.wrapping_add(VAL_SEED_OFFSET * 2), &[SEED_SFT]);
    let copy = (cfg.sft.copy.steps > 0)
        .then(|| copy_pretrain(policy, tok, &cfg.sft.copy, cfg.sft.learning_rate, base))
        .transpose()?;
    if cfg.sft.steps == 0 {
        return Ok(SftReport {
            copy,
            ..SftReport::default()
        });
    }
    let transcripts = sft::agent_transcripts(cfg, tok, kind, cfg.sft.episodes, base)?;
    let value = (cfg.sft.value_loss_coef > 0.0).then(|| sft::ValueWarmup {
        gamma: f64::from(cfg.gamma),
        coef: cfg.sft.value_loss_coef,
        separate: critic.map(|c| (c, cfg.critic.learning_rate)),
    });
    let report = sft::behaviour_clone(
        policy,
        &transcripts.records,
        CloneSettings::from_config(cfg, tok.pad_id(), base),
        value,
    )?;
    Ok(SftReport {
        env_errors: transcripts.env_errors,
        copy,
        ..report
    })
}
