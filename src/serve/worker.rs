//! The gateway's generation loop, on the thread that owns the policy. HTTP handlers send it
//! [`Job`]s. A round is one continuous engine call ([`Engine::generate_continuous`]): before
//! every forward call it takes the completions that arrived, renders each prompt (through the
//! session when it has one) and adds its choices to the running batch, so concurrent requests
//! share forward calls as soon as they arrive and every turn reuses its conversation's KV
//! prefix; each choice's text streams as its tokens are sampled, and a completion is answered
//! and recorded in its session the moment its last choice ends. Session closes and stats wait
//! for the end of the call (none joins it once one waits), then go to the [`Backend`] (a
//! dataset, or the trainer), which may update the policy before the next round: requests
//! arriving meanwhile wait and are served by the new weights. A request offering tools has its
//! reply read for calls in the template's format ([`ToolCallFormat`]): text from where a call may
//! start is held back from the stream, calls go out with ids and `finish_reason: tool_calls`,
//! and a call that does not parse goes out as text and is recorded as a tool-call error.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam::channel::{Receiver, RecvTimeoutError};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::api::{
    finish_reason_name, ApiError, ChatMessage, Completion, PromptTokensDetails, ToolChoice,
    ToolSet, Usage,
};
use super::session::{CloseRequest, ClosedTrajectory, Prompt, Sampled, Sessions, DEFAULT_ENV_TAG};
use crate::model::Model;
use crate::rollout::engine::{
    CacheCounters, Engine, FinishReason, GenRequest, Generation, GenerationFeed,
};
use crate::rollout::grammar::ResponseGrammar;
use crate::rollout::sampling::SamplingParams;
use crate::seed;
use crate::tokenizer::tool_calls::ParsedReply;
use crate::tokenizer::{Tokenizer, ToolCall, ToolCallFormat};

/// Work for the generation thread.
pub enum Job {
    Complete {
        completion: Box<Completion>,
        reply: mpsc::UnboundedSender<Reply>,
    },
    Close {
        session: String,
        request: CloseRequest,
        reply: oneshot::Sender<Result<Value, ApiError>>,
    },
    Stats {
        reply: oneshot::Sender<Value>,
    },
}

/// What a completion's handler hears from the generation thread.
pub enum Reply {
    /// Text of choice `choice` that is final (streamed as a delta), with the log-probs of the
    /// tokens it completes.
    Delta {
        choice: usize,
        text: String,
        logprobs: Vec<(String, f32)>,
    },
    Done(Result<Finished, ApiError>),
}

/// A completed request.
pub struct Finished {
    pub created: u64,
    pub choices: Vec<Choice>,
    pub usage: Usage,
    pub policy_version: u64,
}

pub struct Choice {
    /// `None` when the reply is calls only.
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: &'static str,
    pub logprobs: Vec<(String, f32)>,
}

/// The policy and what becomes of closed sessions.
pub trait Backend {
    /// The engine, model and tokenizer that generate.
    fn parts(&mut self) -> (&mut Engine, &Model, &Tokenizer);
    /// Version of the weights generating now.
    fn policy_version(&self) -> u64;
    /// Answer grammars by env tag: a session whose env tag has one is sampled under it
    /// (constrained decoding; none by default).
    fn grammars(&self) -> BTreeMap<String, Arc<ResponseGrammar>> {
        BTreeMap::new()
    }
    /// Whether a request may constrain its own reply (`tool_choice` required or named). A
    /// backend that records or trains says no: the constrained log-probs would be stored without
    /// the constraint, and an update would score the tokens under a different distribution.
    fn request_grammars(&self) -> bool {
        true
    }
    /// The engine's counters of one generation call (prefix reuse, tokens, forward time).
    fn generated(&mut self, _counters: &CacheCounters) {}
    /// A closed session's steps; returns what the close request answers (ids, counts).
    fn closed(&mut self, trajectory: ClosedTrajectory) -> Result<Value, ApiError>;
    /// Runs after each round of jobs (e.g. a policy update when enough trajectories closed);
    /// `Ok(false)` stops the loop.
    fn after_round(&mut self) -> anyhow::Result<bool>;
    /// Backend-specific figures for `GET /v1/stats`.
    fn stats(&self) -> Value;
}

/// Settings of the generation loop.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// `max_tokens` when a request gives none (capped by the context left).
    pub default_max_tokens: usize,
    /// Longest context + response a request may ask for.
    pub max_context: usize,
    /// Sessions idle longer than this are dropped unrecorded.
    pub session_ttl: Duration,
    /// Seed of choices whose request gives none (with a per-request counter).
    pub seed: u64,
    /// Added to the reward of a recorded step whose tool call did not parse (≤ 0).
    pub tool_call_penalty: f32,
}

/// Completions one engine call takes in; later ones wait for the next call, so a call under
/// steady load still ends and the jobs deferred to its end (closes, stats) are answered.
const MAX_CALL_COMPLETIONS: usize = 256;

/// Runs the loop until the job channel closes or the backend says stop.
pub fn run(
    backend: &mut dyn Backend,
    jobs: &Receiver<Job>,
    opts: &WorkerOptions,
) -> anyhow::Result<()> {
    let mut worker = Worker {
        sessions: Sessions::new(opts.session_ttl, opts.tool_call_penalty),
        opts: opts.clone(),
        requests_seen: 0,
        completions_accepted: 0,
        counters: CacheCounters::default(),
        expired: 0,
    };
    loop {
        let first = match jobs.recv_timeout(Duration::from_secs(1)) {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                worker.expired += worker.sessions.expire(Instant::now());
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        worker.run_round(backend, first, jobs);
        worker.expired += worker.sessions.expire(Instant::now());
        if !backend.after_round()? {
            return Ok(());
        }
    }
}

struct Worker {
    sessions: Sessions,
    opts: WorkerOptions,
    requests_seen: u64,
    /// Completions accepted so far (numbers the seeds of tool-call ids, so that a client that
    /// fixes `seed` still gets ids unique across its turns).
    completions_accepted: u64,
    counters: CacheCounters,
    expired: usize,
}

/// One accepted completion on its way through the engine.
struct Running {
    completion: Completion,
    reply: mpsc::UnboundedSender<Reply>,
    prompt: Prompt,
    max_tokens: usize,
    /// Seed of the ids of the reply's tool calls (unique per completion the worker accepted).
    call_id_seed: u64,
    /// How the reply's tool calls are read (`None`: they are not).
    call_format: Option<ToolCallFormat>,
    streams: Vec<ChoiceStream>,
    generations: Vec<Option<Generation>>,
}

/// One engine call as the feed of [`Engine::generate_continuous`]: completions join it between
/// forward calls as they arrive; session closes and stats wait for its end, and once one waits
/// no new completion joins (the call drains and ends).
struct Call<'a> {
    worker: &'a mut Worker,
    tok: &'a Tokenizer,
    grammars: &'a BTreeMap<String, Arc<ResponseGrammar>>,
    request_grammars: bool,
    jobs: &'a Receiver<Job>,
    first: Option<Job>,
    version: u64,
    running: Vec<Option<Running>>,
    /// Engine request number → (running completion, choice).
    owner: Vec<(usize, usize)>,
    deferred: Vec<Job>,
}

impl GenerationFeed for Call<'_> {
    fn more(&mut self) -> Vec<GenRequest> {
        let mut requests = Vec::new();
        while self.deferred.is_empty() && self.running.len() < MAX_CALL_COMPLETIONS {
            let Some(job) = self.first.take().or_else(|| self.jobs.try_recv().ok()) else {
                break;
            };
            match job {
                Job::Complete { completion, reply } => {
                    self.accept(*completion, reply, &mut requests)
                }
                other => self.deferred.push(other),
            }
        }
        requests
    }

    fn token(&mut self, request: usize, token: u32, logprob: f32) {
        let (r, c) = self.owner[request];
        let Some(run) = self.running[r].as_mut() else {
            return;
        };
        if let Some(delta) = run.streams[c].push(self.tok, token, logprob) {
            if run.completion.stream {
                drop(run.reply.send(delta.into_reply(c, run.completion.logprobs)));
            }
        }
    }

    fn done(&mut self, request: usize, generation: Generation) {
        let (r, c) = self.owner[request];
        let Some(run) = self.running[r].as_mut() else {
            return;
        };
        run.generations[c] = Some(generation);
        if run.generations.iter().all(Option::is_some) {
            let run = self.running[r].take().expect("checked above");
            self.worker.finish(self.tok, run, self.version);
        }
    }
}

impl Call<'_> {
    fn accept(
        &mut self,
        completion: Completion,
        reply: mpsc::UnboundedSender<Reply>,
        requests: &mut Vec<GenRequest>,
    ) {
        let tag = completion.env_tag.as_deref().unwrap_or(DEFAULT_ENV_TAG);
        let env_grammar = self.grammars.get(tag).cloned();
        let accepted = tool_plan(
            self.tok,
            &completion.tools,
            env_grammar,
            self.request_grammars,
        )
        .and_then(|(format, grammar)| {
            self.worker.accept(
                self.tok,
                completion,
                format,
                grammar,
                reply.clone(),
                requests,
            )
        });
        match accepted {
            Ok(run) => {
                let r = self.running.len();
                self.owner.extend((0..run.completion.n).map(|c| (r, c)));
                self.running.push(Some(run));
            }
            Err(e) => drop(reply.send(Reply::Done(Err(e)))),
        }
    }
}

impl Worker {
    /// Serves `first` and whatever joins it in one engine call, then the closes and stats that
    /// waited for its end.
    fn run_round(&mut self, backend: &mut dyn Backend, first: Job, jobs: &Receiver<Job>) {
        let version = backend.policy_version();
        let grammars = backend.grammars();
        let request_grammars = backend.request_grammars();
        let (engine, model, tok) = backend.parts();
        let mut call = Call {
            worker: self,
            tok,
            grammars: &grammars,
            request_grammars,
            jobs,
            first: Some(first),
            version,
            running: Vec::new(),
            owner: Vec::new(),
            deferred: Vec::new(),
        };
        let result = engine.generate_continuous(model, tok, &mut call);
        let Call {
            running, deferred, ..
        } = call;
        let taken = engine.take_counters();
        if let Err(e) = result {
            for run in running.into_iter().flatten() {
                if let Some(id) = &run.completion.session {
                    self.sessions.release(id);
                }
                let err = ApiError::internal(format!("generation failed: {e}"));
                drop(run.reply.send(Reply::Done(Err(err))));
            }
        }
        self.counters.add(&taken);
        self.counters.forward_s += taken.forward_s;
        backend.generated(&taken);
        for job in deferred {
            match job {
                Job::Close {
                    session,
                    request,
                    reply,
                } => {
                    let answer = self
                        .sessions
                        .close(&session, &request)
                        .and_then(|t| backend.closed(t));
                    drop(reply.send(answer));
                }
                Job::Stats { reply } => drop(reply.send(self.stats(backend))),
                Job::Complete { .. } => unreachable!("completions are never deferred"),
            }
        }
    }

    /// Renders a completion's prompt, checks its length and queues one engine request per
    /// choice (sampled under `grammar` when there is one; tool calls read in `call_format`).
    fn accept(
        &mut self,
        tok: &Tokenizer,
        completion: Completion,
        call_format: Option<ToolCallFormat>,
        grammar: Option<Arc<ResponseGrammar>>,
        reply: mpsc::UnboundedSender<Reply>,
        requests: &mut Vec<GenRequest>,
    ) -> Result<Running, ApiError> {
        let prompt = match &completion.session {
            Some(id) => self.sessions.begin(tok, id, &completion)?,
            None => {
                super::session::fresh_prompt(tok, &completion.messages, &completion.tools.schemas)?
            }
        };
        let max_tokens = match self.max_tokens(&completion, prompt.tokens.len()) {
            Ok(m) => m,
            Err(e) => {
                if let Some(id) = &completion.session {
                    self.sessions.release(id);
                }
                return Err(e);
            }
        };
        self.completions_accepted += 1;
        let call_id_seed =
            seed::derive(self.opts.seed, &[CALL_ID_STREAM, self.completions_accepted]);
        let request_seed = completion.seed.unwrap_or_else(|| {
            self.requests_seen += 1;
            seed::derive(self.opts.seed, &[self.requests_seen])
        });
        let mut stop_tokens = vec![tok.eos_id()];
        if tok.pad_id() != tok.eos_id() {
            stop_tokens.push(tok.pad_id());
        }
        for choice in 0..completion.n {
            requests.push(GenRequest {
                tokens: prompt.tokens.clone(),
                traj: seed::derive(request_seed, &[choice as u64]),
                group: request_seed,
                turn: prompt.context_len.min(1) as u32,
                params: sampling(&completion),
                seed: seed::derive(request_seed, &[choice as u64]),
                max_new_tokens: max_tokens,
                stop_token_ids: stop_tokens.clone(),
                stop_strings: completion.stop.clone(),
                grammar: grammar.clone(),
            });
        }
        let streams = (0..completion.n)
            .map(|_| ChoiceStream::new(stop_tokens.clone(), completion.stop.clone(), call_format))
            .collect();
        Ok(Running {
            generations: vec![None; completion.n],
            completion,
            reply,
            prompt,
            max_tokens,
            call_id_seed,
            call_format,
            streams,
        })
    }

    fn max_tokens(&self, c: &Completion, prompt_len: usize) -> Result<usize, ApiError> {
        let room = self.opts.max_context.saturating_sub(prompt_len);
        if room == 0 {
            return Err(context_exceeded(prompt_len, 1, self.opts.max_context));
        }
        match c.max_tokens {
            Some(m) if m > room => Err(context_exceeded(prompt_len, m, self.opts.max_context)),
            Some(m) => Ok(m),
            None => Ok(self.opts.default_max_tokens.min(room)),
        }
    }

    /// Sends a completion's last deltas and its result, and records its turn in its session.
    fn finish(&mut self, tok: &Tokenizer, mut run: Running, version: u64) {
        let gens: Vec<Generation> = std::mem::take(&mut run.generations)
            .into_iter()
            .map(|g| g.expect("finish runs when every choice is done"))
            .collect();
        let mut choices = Vec::with_capacity(gens.len());
        let mut first_reply = None;
        for (c, gen) in gens.iter().enumerate() {
            let stream = &mut run.streams[c];
            let text = stream.final_text(tok, gen);
            let id_seed = seed::derive(run.call_id_seed, &[c as u64]);
            let read = read_reply(&run.completion.tools, run.call_format, &text, id_seed);
            if run.completion.stream {
                let rest = stream.take_rest(read.content.as_deref().unwrap_or_default());
                if !rest.text.is_empty() || !rest.logprobs.is_empty() {
                    drop(run.reply.send(rest.into_reply(c, run.completion.logprobs)));
                }
            }
            let length_cut =
                gen.finish == FinishReason::Length && gen.tokens.len() >= run.max_tokens;
            if c == 0 {
                first_reply = Some((text, read.error.is_some()));
            }
            choices.push(Choice {
                finish_reason: finish_reason_name(length_cut, !read.calls.is_empty()),
                content: read.content,
                tool_calls: read.calls,
                logprobs: std::mem::take(&mut stream.all_logprobs),
            });
        }
        let completion_tokens: usize = gens.iter().map(|g| g.tokens.len()).sum();
        let usage = Usage {
            prompt_tokens: run.prompt.tokens.len(),
            completion_tokens,
            total_tokens: run.prompt.tokens.len() + completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: gens[0].from_cache,
            },
        };
        if let Some(id) = &run.completion.session {
            let gen = &gens[0];
            let (text, tool_call_error) = first_reply.expect("a completion has a choice");
            let sampled = Sampled {
                response_ids: &gen.tokens,
                response_logprobs: &gen.logprobs,
                text,
                reply: ChatMessage {
                    content: choices[0].content.clone(),
                    tool_calls: choices[0].tool_calls.clone(),
                    ..ChatMessage::text("assistant", "")
                },
                tool_call_error,
                policy_version: version,
            };
            let messages = std::mem::take(&mut run.completion.messages);
            let tools = std::mem::take(&mut run.completion.tools.schemas);
            self.sessions
                .finish(id, messages, tools, run.prompt, sampled);
        }
        let finished = Finished {
            created: now_secs(),
            choices,
            usage,
            policy_version: version,
        };
        drop(run.reply.send(Reply::Done(Ok(finished))));
    }

    fn stats(&self, backend: &mut dyn Backend) -> Value {
        let c = &self.counters;
        json!({
            "policy_version": backend.policy_version(),
            "open_sessions": self.sessions.open_count(),
            "expired_sessions": self.expired,
            "requests": c.requests,
            "prompt_tokens": c.prompt_tokens,
            "tokens_prefilled": c.tokens_prefilled,
            "tokens_from_cache": c.tokens_from_cache,
            "prefix_hit_ratio": c.hit_ratio(),
            "completion_tokens": c.decode_tokens,
            "forward_calls": c.forward_calls,
            "forward_s": c.forward_s,
            "backend": backend.stats(),
        })
    }
}

/// Seed stream of the ids of a choice's tool calls.
const CALL_ID_STREAM: u64 = 0x7001;

/// How a request's reply is read and constrained: the tool-call format when calls are read, and
/// the grammar it is sampled under (the env's, or the forced opening of a call when
/// `tool_choice` is required or names a function).
fn tool_plan(
    tok: &Tokenizer,
    tools: &ToolSet,
    env_grammar: Option<Arc<ResponseGrammar>>,
    request_grammars: bool,
) -> Result<(Option<ToolCallFormat>, Option<Arc<ResponseGrammar>>), ApiError> {
    if !tools.parses_calls() {
        return Ok((None, env_grammar));
    }
    let format = tok.tool_call_format().map_err(|e| {
        ApiError::invalid(
            Some("tools"),
            format!("the served model cannot call tools: {e}"),
        )
    })?;
    let forced: Vec<&str> = match &tools.choice {
        ToolChoice::Required => tools.names.iter().map(String::as_str).collect(),
        ToolChoice::Function(name) => vec![name.as_str()],
        ToolChoice::Auto | ToolChoice::None => return Ok((Some(format), env_grammar)),
    };
    let refuse = |why: &str| Err(ApiError::invalid(Some("tool_choice"), why.to_string()));
    if !request_grammars {
        return refuse(
            "this gateway records or trains on its replies, whose log-probs would be stored \
             without the request's constraint: use `auto` (a reply without a call can be \
             penalised by the reward)",
        );
    }
    if env_grammar.is_some() {
        return refuse("this session's env tag already constrains its answers");
    }
    let openings: Vec<String> = forced.iter().map(|n| format.call_opening(n)).collect();
    let grammar = ResponseGrammar::tool_call(tok, &openings)
        .map_err(|e| ApiError::invalid(Some("tool_choice"), e.to_string()))?;
    Ok((Some(format), Some(Arc::new(grammar))))
}

/// A reply as the client gets it.
struct ReadReply {
    content: Option<String>,
    calls: Vec<ToolCall>,
    /// Why a call it attempted did not parse (the text is then the content).
    error: Option<String>,
}

/// Reads the calls in a choice's `text` (ids drawn from `id_seed`).
fn read_reply(
    tools: &ToolSet,
    format: Option<ToolCallFormat>,
    text: &str,
    id_seed: u64,
) -> ReadReply {
    let as_content = |error: Option<String>| ReadReply {
        content: Some(text.to_string()),
        calls: Vec::new(),
        error,
    };
    let Some(format) = format else {
        return as_content(None);
    };
    let known: Vec<&str> = tools.names.iter().map(String::as_str).collect();
    let (content, calls) = match format.parse(text, &known) {
        ParsedReply::Content if tools.choice == ToolChoice::Auto => return as_content(None),
        ParsedReply::Content => {
            return as_content(Some(
                "tool_choice asks for a call and the reply made none".into(),
            ))
        }
        ParsedReply::Malformed { reason } => return as_content(Some(reason)),
        ParsedReply::Calls { content, calls } => (content, calls),
    };
    if !tools.parallel && calls.len() > 1 {
        return as_content(Some(format!(
            "{} calls with parallel_tool_calls false",
            calls.len()
        )));
    }
    if let ToolChoice::Function(name) = &tools.choice {
        if let Some(other) = calls.iter().find(|c| &c.name != name) {
            return as_content(Some(format!(
                "tool_choice names `{name}`, the reply called `{}`",
                other.name
            )));
        }
    }
    let calls = calls
        .into_iter()
        .enumerate()
        .map(|(k, c)| ToolCall {
            id: format!("call_{:016x}", seed::derive(id_seed, &[k as u64])),
            name: c.name,
            arguments: c.arguments,
        })
        .collect();
    ReadReply {
        content,
        calls,
        error: None,
    }
}

fn sampling(c: &Completion) -> SamplingParams {
    if c.temperature == 0.0 {
        return SamplingParams::greedy();
    }
    SamplingParams {
        temperature: c.temperature,
        top_p: c.top_p,
        top_k: 0,
        greedy: false,
    }
}

fn context_exceeded(prompt: usize, asked: usize, max: usize) -> ApiError {
    ApiError::invalid(
        Some("messages"),
        format!(
            "this model's context holds {max} tokens; the prompt has {prompt} and {asked} more were asked for"
        ),
    )
    .with_code(axum::http::StatusCode::BAD_REQUEST, "context_length_exceeded")
}

/// A choice's text as it streams: the tokens so far, how much of their text was sent, and the
/// log-probs not yet sent. Text that could be the start of a stop string, or an incomplete UTF-8
/// sequence, is held back until the next token decides it.
struct ChoiceStream {
    stop_tokens: Vec<u32>,
    stop_strings: Vec<String>,
    /// Text from where a tool call may start is held back until the reply ends.
    call_format: Option<ToolCallFormat>,
    tokens: Vec<u32>,
    sent: usize,
    unsent_logprobs: Vec<(String, f32)>,
    all_logprobs: Vec<(String, f32)>,
}

/// Text (and log-probs) to send for one choice.
struct Delta {
    text: String,
    logprobs: Vec<(String, f32)>,
}

impl Delta {
    fn into_reply(self, choice: usize, with_logprobs: bool) -> Reply {
        Reply::Delta {
            choice,
            text: self.text,
            logprobs: if with_logprobs {
                self.logprobs
            } else {
                Vec::new()
            },
        }
    }
}

impl ChoiceStream {
    fn new(
        stop_tokens: Vec<u32>,
        stop_strings: Vec<String>,
        call_format: Option<ToolCallFormat>,
    ) -> Self {
        Self {
            stop_tokens,
            stop_strings,
            call_format,
            tokens: Vec::new(),
            sent: 0,
            unsent_logprobs: Vec::new(),
            all_logprobs: Vec::new(),
        }
    }

    /// Takes a sampled token; returns the text that became final, if any.
    fn push(&mut self, tok: &Tokenizer, token: u32, logprob: f32) -> Option<Delta> {
        let piece = (tok.decode(&[token]), logprob);
        self.unsent_logprobs.push(piece.clone());
        self.all_logprobs.push(piece);
        if self.stop_tokens.contains(&token) {
            return None;
        }
        self.tokens.push(token);
        let text = tok.decode(&self.tokens);
        let visible = cut_at_stop(&text, &self.stop_strings);
        let mut safe = if visible.len() < text.len() {
            visible.len()
        } else {
            safe_prefix_len(visible, &self.stop_strings)
        };
        if let Some(start) = self.call_format.and_then(|f| f.call_start(visible)) {
            safe = safe.min(start);
        }
        if safe <= self.sent {
            return None;
        }
        let delta = Delta {
            text: visible[self.sent..safe].to_string(),
            logprobs: std::mem::take(&mut self.unsent_logprobs),
        };
        self.sent = safe;
        Some(delta)
    }

    /// The reply text of a finished choice: its tokens without the stop token, cut before a
    /// stop string.
    fn final_text(&self, tok: &Tokenizer, gen: &Generation) -> String {
        let body: Vec<u32> = gen
            .tokens
            .iter()
            .copied()
            .filter(|t| !self.stop_tokens.contains(t))
            .collect();
        cut_at_stop(&tok.decode(&body), &self.stop_strings).to_string()
    }

    /// What was not streamed yet of the final `text` (the reply's content: calls are sent
    /// apart, and were held back).
    fn take_rest(&mut self, text: &str) -> Delta {
        let rest = text.get(self.sent..).unwrap_or_default().to_string();
        self.sent = text.len();
        Delta {
            text: rest,
            logprobs: std::mem::take(&mut self.unsent_logprobs),
        }
    }
}

/// `text` before the first occurrence of any stop string.
fn cut_at_stop<'a>(text: &'a str, stops: &[String]) -> &'a str {
    let end = stops
        .iter()
        .filter_map(|s| text.find(s.as_str()))
        .min()
        .unwrap_or(text.len());
    &text[..end]
}

/// Length of the prefix of `text` that is final: without a trailing replacement character (an
/// incomplete UTF-8 sequence) and without the longest suffix that begins a stop string.
fn safe_prefix_len(text: &str, stops: &[String]) -> usize {
    let text = text.trim_end_matches('\u{FFFD}');
    let held = stops
        .iter()
        .flat_map(|s| {
            (1..s.len())
                .filter(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k]))
                .max()
        })
        .max()
        .unwrap_or(0);
    text.len() - held
}

pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_until_decided() {
        let stops = vec!["</answer>".to_string()];
        assert_eq!(
            safe_prefix_len("<answer>Left</an", &stops),
            "<answer>Left".len()
        );
        assert_eq!(
            safe_prefix_len("<answer>Left", &stops),
            "<answer>Left".len()
        );
        assert_eq!(safe_prefix_len("abc\u{FFFD}", &stops), 3);
        assert_eq!(
            cut_at_stop("<answer>Left</answer> more", &stops),
            "<answer>Left"
        );
    }

    #[test]
    fn streamed_deltas_add_up_to_the_final_text() {
        let tok = Tokenizer::builtin();
        let stops = vec!["</answer>".to_string()];
        let mut stream = ChoiceStream::new(vec![tok.eos_id()], stops, None);
        let mut tokens = tok.encode("<answer>Left</answer>");
        tokens.push(tok.eos_id());
        let mut streamed = String::new();
        for &t in &tokens {
            if let Some(d) = stream.push(&tok, t, -1.0) {
                streamed.push_str(&d.text);
            }
        }
        let gen = Generation {
            tokens: tokens.clone(),
            logprobs: vec![-1.0; tokens.len()],
            finish: FinishReason::StopToken,
            prefilled: 0,
            from_cache: 0,
        };
        let text = stream.final_text(&tok, &gen);
        streamed.push_str(&stream.take_rest(&text).text);
        assert_eq!(text, "<answer>Left");
        assert_eq!(streamed, text);
        assert_eq!(stream.all_logprobs.len(), tokens.len());
    }
}
