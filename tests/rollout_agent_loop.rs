//! Agent loop: token-space contexts, both layouts, cache exactness and policy-version flushes.

use candle_core::Device;
use stepppo::model::{Model, ModelConfig};
use stepppo::rollout::agent_loop::{run_rollout, ContextLayout, Rollout, RolloutConfig};
use stepppo::rollout::engine::{CacheMode, Engine, EngineConfig};
use stepppo::store::StepRecord;
use stepppo::tokenizer::{ChatTemplate, Tokenizer};
use stepppo::train::learner::batch::trajectories;
use stepppo::train::learner::masks::ResponseMasks;
use stepppo::train::learner::scoring::response_logprobs;
use stepppo::train::BatchLayout;

struct Setup {
    tok: Tokenizer,
    model: Model,
    engine: Engine,
}

fn setup(mode: CacheMode) -> Setup {
    let tok = Tokenizer::builtin();
    let cfg = ModelConfig::tiny(tok.vocab_size());
    let model = Model::new(&cfg, 3, &Device::Cpu).unwrap();
    let engine_cfg = EngineConfig {
        cache_mode: mode,
        num_slots: 16_384,
        ..EngineConfig::default()
    };
    let engine = Engine::new(&cfg, engine_cfg, &Device::Cpu).unwrap();
    Setup { tok, model, engine }
}

fn config(layout: ContextLayout) -> RolloutConfig {
    RolloutConfig {
        env_config: serde_json::json!({ "max_turns": 3 }),
        num_groups: 2,
        group_size: 3,
        base_seed: 9,
        max_new_tokens: 10,
        max_turns: 8,
        layout,
        ..RolloutConfig::default()
    }
}

fn rollout(s: &mut Setup, cfg: &RolloutConfig, sunk: &mut Vec<StepRecord>) -> Rollout {
    let mut sink = |r: &StepRecord| {
        sunk.push(r.clone());
        Ok(())
    };
    run_rollout(
        &mut s.engine,
        &s.model,
        &s.tok,
        &ChatTemplate,
        cfg,
        &mut sink,
    )
    .unwrap()
}

#[test]
fn concat_contexts_extend_in_token_space_and_groups_share_the_prompt() {
    let mut s = setup(CacheMode::Radix);
    let mut sunk = Vec::new();
    let out = rollout(&mut s, &config(ContextLayout::Concat), &mut sunk);
    assert_eq!(sunk.len(), out.records.len());
    assert_eq!(out.stats.trajectories, 6);
    for traj in out.records.chunk_by(|a, b| a.traj_id == b.traj_id) {
        let mut len = 0;
        for (t, r) in traj.iter().enumerate() {
            assert_eq!(r.step_index as usize, t);
            assert_eq!(
                r.context_len as usize, len,
                "context_len is the tokens before obs_ids"
            );
            assert_eq!(r.response_ids.len(), r.response_logprobs.len());
            assert_eq!(r.is_last(), t + 1 == traj.len());
            len += r.obs_ids.len() + r.response_ids.len();
        }
    }
    let firsts: Vec<&StepRecord> = out.records.iter().filter(|r| r.step_index == 0).collect();
    for pair in firsts.windows(2) {
        let same_group = pair[0].group_id == pair[1].group_id;
        assert_eq!(pair[0].obs_ids == pair[1].obs_ids, same_group);
    }
    assert!(out.stats.cache.tokens_from_cache > 0);
}

#[test]
fn radix_and_no_cache_rollouts_are_identical() {
    let cfg = config(ContextLayout::Concat);
    let a = rollout(&mut setup(CacheMode::None), &cfg, &mut Vec::new());
    let b = rollout(&mut setup(CacheMode::Radix), &cfg, &mut Vec::new());
    assert_eq!(a.records.len(), b.records.len());
    for (x, y) in a.records.iter().zip(&b.records) {
        assert_eq!((x.traj_id, x.step_index), (y.traj_id, y.step_index));
        assert_eq!(x.obs_ids, y.obs_ids);
        assert_eq!(x.response_ids, y.response_ids);
        for (p, q) in x.response_logprobs.iter().zip(&y.response_logprobs) {
            assert!((p - q).abs() < 1e-4, "|Δlogprob| = {}", (p - q).abs());
        }
    }
    assert!(b.stats.cache.tokens_prefilled * 2 < a.stats.cache.tokens_prefilled);
    assert_eq!(a.stats.cache.prompt_tokens, b.stats.cache.prompt_tokens);
}

#[test]
fn window_layout_starts_every_step_afresh() {
    let mut s = setup(CacheMode::Radix);
    let out = rollout(
        &mut s,
        &config(ContextLayout::Window { k: 1 }),
        &mut Vec::new(),
    );
    let system = ChatTemplate
        .system(&s.tok, &{
            let session =
                stepppo::env::build_session("frozen_lake", &serde_json::json!({})).unwrap();
            session.system_prompt()
        })
        .unwrap();
    for r in &out.records {
        assert_eq!(r.context_len, 0);
        assert!(r.obs_ids.starts_with(&system));
    }
    assert!(
        out.stats.cache.hit_ratio() > 0.3,
        "the stable head is shared"
    );
}

#[test]
fn window_layout_without_history_prompts_with_the_current_state_only() {
    let mut s = setup(CacheMode::Radix);
    let out = rollout(
        &mut s,
        &config(ContextLayout::Window { k: 0 }),
        &mut Vec::new(),
    );
    let later: Vec<_> = out.records.iter().filter(|r| r.step_index > 0).collect();
    assert!(!later.is_empty(), "some episode lasted past its first step");
    for r in later {
        let prompt = s.tok.decode(&r.obs_ids);
        assert!(!prompt.contains("Recent history"), "{prompt}");
        assert_eq!(prompt.matches("State:").count(), 1, "{prompt}");
    }
}

#[test]
fn a_new_policy_version_is_never_served_old_prefixes() {
    let mut s = setup(CacheMode::Radix);
    let cfg = config(ContextLayout::Concat);
    let first = rollout(&mut s, &cfg, &mut Vec::new());
    s.engine.set_policy_version(1).unwrap();
    let second = rollout(&mut s, &cfg, &mut Vec::new());
    assert!(second.records.iter().all(|r| r.policy_version == 1));
    assert_eq!(
        first.stats.cache.tokens_from_cache, second.stats.cache.tokens_from_cache,
        "the same rollout after a flush reuses only what it computed itself"
    );
    let mut unflushed = setup(CacheMode::Radix);
    rollout(&mut unflushed, &cfg, &mut Vec::new());
    let again = rollout(&mut unflushed, &cfg, &mut Vec::new());
    assert!(again.stats.cache.tokens_from_cache > second.stats.cache.tokens_from_cache);
}

#[test]
fn constrained_decoding_answers_with_an_action_and_the_update_scores_it_alike() {
    let mut s = setup(CacheMode::Radix);
    let cfg = RolloutConfig {
        constrained_decoding: true,
        ..config(ContextLayout::Concat)
    };
    let out = rollout(&mut s, &cfg, &mut Vec::new());
    let names = ["Left", "Down", "Right", "Up"];
    for r in &out.records {
        let text = s.tok.decode(&r.response_ids);
        let action = text
            .strip_prefix("<answer>")
            .and_then(|t| t.strip_suffix("</answer>"))
            .unwrap_or_else(|| panic!("not an answer: {text:?}"));
        assert!(names.contains(&action), "{text:?}");
        assert!(r.info.action_is_valid, "{text:?}");
        // The tags are forced: log-prob 0.
        let lp = &r.response_logprobs;
        assert_eq!((lp[0], lp[lp.len() - 1]), (0.0, 0.0), "{text:?}");
    }
    // The update recomputes the rollout's log-probs under the same grammar (ratio 1); without
    // it the action tokens score lower, over the whole vocabulary.
    let session = stepppo::env::build_session("frozen_lake", &cfg.env_config).unwrap();
    let tag = out.records[0].env_tag.clone();
    let vocab = s.model.config().vocab_size;
    let masks = ResponseMasks::for_envs(&s.tok, [(tag, session)], vocab).unwrap();
    let seqs = trajectories(&out.records);
    let layout = BatchLayout {
        pad_id: s.tok.pad_id(),
        tree: true,
    };
    let scored =
        response_logprobs(&s.model, &out.records, &seqs, (4, layout), 1.0, &masks).unwrap();
    let free = response_logprobs(
        &s.model,
        &out.records,
        &seqs,
        (4, layout),
        1.0,
        &ResponseMasks::default(),
    )
    .unwrap();
    for (r, (lp, free)) in out.records.iter().zip(scored.iter().zip(&free)) {
        for (j, (&a, &b)) in r.response_logprobs.iter().zip(lp).enumerate() {
            assert!((a - b).abs() < 1e-4, "token {j}: rollout {a} update {b}");
        }
        assert!(free[1] < lp[1] - 1e-3, "{free:?} vs {lp:?}");
    }
}

/// With `num_levels`, groups cycle through that many levels: group g plays level g mod n (the
/// same map, so the same first observation), while its sampling stays its own.
#[test]
fn a_finite_level_set_repeats_levels_across_groups() {
    let mut s = setup(CacheMode::Radix);
    let first_obs = |out: &Rollout, group: u64| {
        let r = out
            .records
            .iter()
            .find(|r| r.group_id == group && r.step_index == 0)
            .unwrap();
        (r.state_hash, r.obs_ids.clone())
    };
    let levels = RolloutConfig {
        num_groups: 4,
        num_levels: Some(2),
        ..config(ContextLayout::Concat)
    };
    let out = rollout(&mut s, &levels, &mut Vec::new());
    assert_eq!(first_obs(&out, 0), first_obs(&out, 2));
    assert_eq!(first_obs(&out, 1), first_obs(&out, 3));
    assert_ne!(first_obs(&out, 0).0, first_obs(&out, 1).0);
    let unbounded = rollout(
        &mut s,
        &RolloutConfig {
            num_groups: 4,
            ..config(ContextLayout::Concat)
        },
        &mut Vec::new(),
    );
    assert_ne!(first_obs(&unbounded, 0).0, first_obs(&unbounded, 2).0);
}

/// Search QA on generated worlds, in the protocol's tool mode, three turns.
fn search_env_in_tool_mode() -> serde_json::Value {
    serde_json::json!({
        "world": "generated", "world_size": 60, "episode_worlds": true,
        "corpus": "distractor", "tools": true, "max_turns": 3,
    })
}

/// Tool mode in-process: the first prompt offers the env's functions, and each trajectory's
/// context, built turn by turn after the sampled tokens, is the template's rendering of its
/// whole conversation (the untrained model calls nothing, so each turn after the first is the
/// user message asking for a call); a config that asks for the window layout is refused.
#[test]
fn tool_mode_contexts_are_the_whole_conversations_rendering() {
    use stepppo::tokenizer::Message;
    let mut s = setup(CacheMode::Radix);
    let tools_env = search_env_in_tool_mode();
    let cfg = RolloutConfig {
        env_name: "hotpotqa".into(),
        env_config: tools_env,
        num_groups: 1,
        group_size: 2,
        max_new_tokens: 6,
        ..config(ContextLayout::Concat)
    };
    let mut sunk = Vec::new();
    let out = rollout(&mut s, &cfg, &mut sunk);
    let mut session = stepppo::env::build_session("hotpotqa", &cfg.env_config).unwrap();
    for traj in trajectories(&out.records) {
        let records: Vec<&StepRecord> = traj.iter().map(|&i| &out.records[i]).collect();
        let first = session.reset(records[0].seed).unwrap();
        let mut context: Vec<u32> = Vec::new();
        for r in &records {
            context.extend(&r.obs_ids);
            context.extend(&r.response_ids);
        }
        let texts: Vec<String> = records
            .iter()
            .map(|r| s.tok.decode(&r.response_ids))
            .collect();
        let system = session.system_prompt();
        let nudge = "(invalid turn) Call one of the functions offered: search, answer.";
        let mut messages = vec![
            Message::text("system", &system),
            Message::text("user", &first),
        ];
        for (i, text) in texts.iter().enumerate() {
            messages.push(Message::text("assistant", text));
            if i + 1 < texts.len() {
                messages.push(Message::text("user", nudge));
            }
        }
        let last = records.last().unwrap();
        assert!(last.truncated && !last.info.action_is_valid);
        let mut whole = ChatTemplate
            .conversation_with_tools(
                &s.tok,
                &messages[..messages.len() - 1],
                &session.tool_schemas(),
            )
            .unwrap();
        whole.extend(&last.response_ids);
        assert_eq!(s.tok.decode(&context), s.tok.decode(&whole));
        assert!(s.tok.decode(&records[0].obs_ids).contains("<tools>"));
    }
    let window = RolloutConfig {
        layout: ContextLayout::Window { k: 0 },
        ..cfg
    };
    let mut s = setup(CacheMode::Radix);
    let err = run_rollout(
        &mut s.engine,
        &s.model,
        &s.tok,
        &ChatTemplate,
        &window,
        &mut |_| Ok(()),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("tools: true") && err.contains("concat"),
        "{err}"
    );
}

/// Tool mode with a model that calls: the tiny model cloned on the oracle's tool-mode transcript
/// of one episode calls `search` in the rollout, its reply (read up to its end of turn) is a
/// valid call, and the next step's context opens with the tool result.
#[test]
fn tool_mode_reads_a_cloned_models_call_and_answers_with_the_tool_result() {
    use stepppo::env::{build_session, Agent, AgentKind};
    use stepppo::rollout::sampling::SamplingParams;
    use stepppo::store::{agent_episode, EpisodeIds};
    use stepppo::train::warm_start::sft::{behaviour_clone, CloneSettings};
    let mut s = setup(CacheMode::Radix);
    let env_config = search_env_in_tool_mode();
    let cfg = RolloutConfig {
        env_name: "hotpotqa".into(),
        env_config: env_config.clone(),
        num_groups: 1,
        group_size: 1,
        sampling: SamplingParams::greedy(),
        max_new_tokens: 80,
        ..config(ContextLayout::Concat)
    };
    let env_seed = stepppo::seed::derive(cfg.base_seed, &[0]);
    let mut session = build_session("hotpotqa", &env_config).unwrap();
    let ids = EpisodeIds {
        traj_id: 0,
        group_id: 0,
        env_seed,
        env_tag: "hotpotqa".into(),
    };
    let transcript = agent_episode(
        &mut session,
        &mut Agent::new(AgentKind::Oracle, 1),
        &ids,
        &s.tok,
    )
    .unwrap();
    let first = transcript[..1].to_vec();
    let settings = CloneSettings {
        steps: 150,
        batch_size: 1,
        lr: 3e-3,
        observation_loss_coef: 0.0,
        seed: 0,
        layout: BatchLayout {
            pad_id: s.tok.pad_id(),
            tree: false,
        },
    };
    behaviour_clone(&s.model, &first, settings, None).unwrap();
    let mut sunk = Vec::new();
    let out = rollout(&mut s, &cfg, &mut sunk);
    let step0 = &out.records[0];
    assert_eq!(step0.response_ids, first[0].response_ids, "the cloned call");
    assert!(
        step0.info.action_is_valid && !step0.info.tool_call_error,
        "{:?}",
        step0.info
    );
    let next = s.tok.decode(&out.records[1].obs_ids);
    assert!(next.contains("<tool_response>\n<information>"), "{next}");
}
