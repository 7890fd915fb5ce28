//! The tokenizer: a wrapper over `tokenizers`, the built-in vocabulary, and chat templates (the
//! built-in one, or a checkpoint's own Jinja template).
//!
//! [`Tokenizer`] wraps a `tokenizers::Tokenizer`: either loaded from an HF checkpoint directory
//! (`tokenizer.json`, plus `tokenizer_config.json` / `chat_template.jinja` for its end-of-turn
//! token and chat template) or the built-in one, a byte-level BPE whose base vocabulary is the 256 byte symbols (so any text encodes
//! without unknown tokens and decodes exactly) plus whole-word tokens for a fixed word list (env
//! templates, actions, roles, common English) that are looked up directly (`ignore_merges`), plus
//! the special tokens of the chat template and the agent tags. [`ChatTemplate`] produces the token
//! pieces of a conversation: through the checkpoint's own Jinja template ([`jinja`]) when the
//! tokenizer has one, so the ids equal transformers' `apply_chat_template`, else Qwen-style
//! `<|im_start|>role\n…<|im_end|>\n` turns built in token space. Model code lives in
//! [`crate::model`].

pub mod conversation;
mod hf_files;
pub mod jinja;
pub mod tool_calls;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

pub use conversation::{Followup, ToolConversation};
pub use jinja::{JinjaTemplate, Message};
pub use tool_calls::{ToolCall, ToolCallFormat};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// Errors of the tokenizer module; each names the file involved.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file could not be read or parsed.
    #[error("loading tokenizer {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// The underlying error.
        message: String,
    },
    /// A tokenizer file could not be written.
    #[error("saving tokenizer {path}: {message}")]
    Save {
        /// The file.
        path: String,
        /// The underlying error.
        message: String,
    },
    /// The vocabulary lacks the end-of-turn token.
    #[error("tokenizer {path} has no end-of-turn token `{token}`")]
    MissingSpecial {
        /// The tokenizer file.
        path: String,
        /// The token looked for, e.g. `<|im_end|>`.
        token: String,
    },
    /// The built-in tokenizer could not be assembled; holds the library's error.
    #[error("building the built-in tokenizer: {0}")]
    Build(String),
    /// The chat template fails to parse or render, or cannot be extended turn by turn in tokens.
    #[error("chat template of {path}: {message}")]
    Template {
        /// Where the template came from.
        path: String,
        /// What went wrong.
        message: String,
    },
}

/// Result of the tokenizer module's fallible operations.
pub type Result<T> = std::result::Result<T, TokenizerError>;

/// End of text (also the padding id of the built-in model).
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// Opens a chat turn.
pub const IM_START: &str = "<|im_start|>";
/// Closes a chat turn; the end-of-sequence token of generation.
pub const IM_END: &str = "<|im_end|>";

/// Special tokens of the built-in tokenizer, in id order after the regular vocabulary.
pub const SPECIAL_TOKENS: [&str; 11] = [
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
];

/// Words that get a whole-word token, with and without a leading space. Sorted and de-duplicated
/// at build time, so the order here does not matter. Only letter runs (the byte-level
/// pre-tokenizer keeps them in one piece) and a few punctuation runs.
const BUILTIN_WORDS: &str = "
system user assistant tool
Left Down Right Up left down right up Phoenix Dragon phoenix dragon Teacher Engineer Librarian Trader
teacher engineer librarian trader arm arms
You You're are solving the FrozenLake puzzle Forbid whole and go to target may move unintended direction
due slippery ice Sokoban player you need push all boxes targets When right next box can it by moving in
same cannot through wall pull The meaning of each symbol state is Your available actions You make
actions separated action separator Turn State have left Always output Your thoughts your answer with no
extra text Strictly follow this format Max response length words tokens Reward Observation Decide next
helpful assistant good game aiming get high reward in Answer must be one turn format At did not provide
valid hole goal empty on Legend legend Player Goal Hole Wall Box Target Empty Frozen frozen
playing bandit Maximize total choosing which Game Rules There named has its own distribution related
their names Analyze symbolic guess how might behave Based think more likely give higher rewards average
Choose between like or points
Prior step steps completed Recent History Below most recent observations responses Current currently at
Env Instruction Description Requirement
given question must conduct reasoning inside first every time new information After if find lack some
knowledge call search engine query will return top searched results between as many times want
further external needed directly provide without detailed illustrations For example Question Doc Title
research agent Goal User Query using Wikipedia evidence History Actions Retrieved Passages Recent
issues Instructions Output Format Search analysis expert tasked answering step taken interaction where
wrapped past queries corresponding My previous invalid If I should put Let me try again Reached maximum
number use Please final
a an the of to in is was for on that by with as at from it he she his her they them this which who whom
whose what when where why how were be been has had do does did not no yes but also than then there
these those such only other into over after before during about between both either neither same
first second third one two three four five six seven eight nine ten hundred thousand million year years
born died city country state river county film album song band book novel series team club player
American British English French German Italian Spanish Japanese Chinese Canadian Australian Indian
Russian nationality released founded located known named called became based American used won
directed written played starring member members company university school college county district
national international world war president king queen prince actor actress singer writer director
producer author politician footballer musician founder located capital largest population older younger
same different Were Was Is Are Which Who What When Where How Did Do Does In
true false correct wrong
";

/// Punctuation and whitespace runs that get their own token (the byte-level regex keeps each whole).
const BUILTIN_SYMBOL_RUNS: [&str; 8] = ["||", " ||", "\n\n", ":\n", ".\n", "...", "**", "##"];

/// HF name of the tokenizer file of a checkpoint directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// HF name of the tokenizer settings (special tokens, chat template) of a checkpoint directory.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// transformers 5's file for the chat template; it wins over `tokenizer_config.json`'s.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// A tokenizer: HF `tokenizers` model plus the ids stepppo needs and, for a checkpoint that has
/// one, its chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos_id: u32,
    chat_template: Option<Arc<JinjaTemplate>>,
    /// `tokenizer_config.json` / `chat_template.jinja` as loaded, written back by `save_dir`.
    settings_files: Arc<Vec<(&'static str, String)>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_id", &self.eos_id)
            .finish()
    }
}

impl Tokenizer {
    /// The built-in byte-level tokenizer (deterministic, cheap to build).
    pub fn builtin() -> Self {
        Self::builtin_with_words(&[])
    }

    /// The built-in tokenizer with whole-word tokens for `words` too (with and without a
    /// leading space): the words an env writes (e.g. a generated QA world's names), so that the
    /// model copies a name as one token instead of spelling it byte by byte. The new words are
    /// numbered after the built-in bytes and words, whose ids do not move; the special tokens
    /// (`<|im_start|>`, `<answer>`, …) come after them, so their ids grow by the number of new
    /// pieces. Words must be letter runs or punctuation runs ([`builtin_pieces_of`]).
    pub fn builtin_with_words(words: &[String]) -> Self {
        assert!(
            words.iter().all(|w| is_builtin_piece(w)),
            "extra built-in words are letter runs or punctuation runs"
        );
        Self::try_builtin(words).expect("the built-in word list is valid by construction")
    }

    fn try_builtin(words: &[String]) -> Result<Self> {
        let byte_chars = byte_to_unicode();
        let mut vocab: HashMap<String, u32> = HashMap::new();
        for ch in byte_chars.iter() {
            let id = vocab.len() as u32;
            vocab.insert(ch.to_string(), id);
        }
        for piece in builtin_pieces().into_iter().chain(word_pieces(words)) {
            let token: String = piece.bytes().map(|b| byte_chars[b as usize]).collect();
            if !vocab.contains_key(&token) {
                let id = vocab.len() as u32;
                vocab.insert(token, id);
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(
                vocab
                    .into_iter()
                    .collect::<tokenizers::models::bpe::Vocab>(),
                Vec::new(),
            )
            .ignore_merges(true)
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        inner
            .add_special_tokens(SPECIAL_TOKENS.iter().map(|t| AddedToken::from(*t, true)))
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        Self::wrap(inner, "<builtin>")
    }

    /// Loads an HF `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::wrap(inner, &path.display().to_string())
    }

    fn wrap(inner: tokenizers::Tokenizer, origin: &str) -> Result<Self> {
        let eos_id = inner
            .token_to_id(IM_END)
            .ok_or_else(|| TokenizerError::MissingSpecial {
                path: origin.to_string(),
                token: IM_END.to_string(),
            })?;
        Ok(Self {
            inner,
            eos_id,
            chat_template: None,
            settings_files: Arc::default(),
        })
    }

    /// Loads a checkpoint directory's tokenizer: `tokenizer.json`, and from
    /// `tokenizer_config.json` the end-of-turn token (`<|im_end|>` when the vocabulary has it,
    /// else `eos_token`) and the chat template (`chat_template.jinja` first, else the config's
    /// `chat_template`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join(TOKENIZER_FILE);
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let settings = hf_files::Settings::read(dir)?;
        let eos = match inner.token_to_id(IM_END) {
            Some(_) => IM_END.to_string(),
            None => settings.eos_token.clone().unwrap_or(IM_END.to_string()),
        };
        let eos_id = inner
            .token_to_id(&eos)
            .ok_or_else(|| TokenizerError::MissingSpecial {
                path: path.display().to_string(),
                token: eos.clone(),
            })?;
        let chat_template = settings.template()?.map(Arc::new);
        Ok(Self {
            inner,
            eos_id,
            chat_template,
            settings_files: Arc::new(settings.files),
        })
    }

    /// Writes `tokenizer.json` and the `tokenizer_config.json` / `chat_template.jinja` it was
    /// loaded with, unchanged, so transformers loads the same tokenizer and template.
    pub fn save_dir(&self, dir: &Path) -> Result<()> {
        self.save(dir.join(TOKENIZER_FILE))?;
        hf_files::write(dir, &self.settings_files)
    }

    /// The checkpoint's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&JinjaTemplate> {
        self.chat_template.as_deref()
    }

    /// How this tokenizer's chat template writes tool calls (the built-in one: Hermes).
    pub fn tool_call_format(&self) -> std::result::Result<ToolCallFormat, String> {
        ToolCallFormat::of_template(self.chat_template().map(JinjaTemplate::source))
    }

    /// Writes `tokenizer.json` that [`Tokenizer::from_file`] (and HF) load back identically.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        self.inner
            .save(path, true)
            .map_err(|e| TokenizerError::Save {
                path: path.display().to_string(),
                message: e.to_string(),
            })
    }

    /// Token ids of `text`; special-token strings in the text become their special ids.
    /// A byte-level tokenizer cannot fail here; a loaded tokenizer that fails yields no ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }

    /// Text of `ids`, special tokens included; unknown ids are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// The end-of-turn id `<|im_end|>`, where generation stops.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// Id of a token string (e.g. a special token), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Padding id: `<|endoftext|>` when present, else the end-of-turn id.
    pub fn pad_id(&self) -> u32 {
        self.token_id(ENDOFTEXT).unwrap_or(self.eos_id)
    }

    /// Number of ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Every id that is not an added (special) token, ascending: the tokens text is made of.
    pub fn ordinary_ids(&self) -> Vec<u32> {
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size() as u32)
            .filter(|id| !added.contains_key(id))
            .collect()
    }
}

/// Every word of the built-in list with and without a leading space, plus the symbol runs.
fn builtin_pieces() -> BTreeSet<String> {
    let mut pieces: BTreeSet<String> = BUILTIN_SYMBOL_RUNS.iter().map(|s| s.to_string()).collect();
    pieces.extend(word_pieces(BUILTIN_WORDS.split_whitespace()));
    pieces
}

/// The pieces of `text` that the built-in tokenizer can hold whole, without their leading
/// space: each run of two or more letters or punctuation characters that the byte-level
/// pre-tokenizer splits `text` into (single characters are bytes already; digits and whitespace
/// stay bytes). Given to [`Tokenizer::builtin_with_words`], they make `text` encode in about
/// one token per piece.
pub fn builtin_pieces_of(text: &str) -> Vec<String> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let mut split = PreTokenizedString::from(text);
    ByteLevel::new(false, true, true)
        .pre_tokenize(&mut split)
        .expect("the byte-level pre-tokenizer splits any text");
    let pieces: BTreeSet<String> = split
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(_, (start, end), _)| text[start..end].trim_start_matches(' ').to_string())
        .filter(|piece| piece.chars().count() > 1 && is_builtin_piece(piece))
        .collect();
    pieces.into_iter().collect()
}

/// Whether `piece` is one pre-token of the byte-level split: letters only, or punctuation only
/// (neither letters, digits nor whitespace).
fn is_builtin_piece(piece: &str) -> bool {
    let punctuation = |c: char| !(c.is_alphabetic() || c.is_numeric() || c.is_whitespace());
    !piece.is_empty() && (piece.chars().all(char::is_alphabetic) || piece.chars().all(punctuation))
}

/// Each word with and without a leading space (a one-letter word is a byte token already).
fn word_pieces<S: AsRef<str>>(words: impl IntoIterator<Item = S>) -> BTreeSet<String> {
    let mut pieces = BTreeSet::new();
    for word in words {
        let word = word.as_ref();
        if word.len() > 1 {
            pieces.insert(word.to_string());
        }
        pieces.insert(format!(" {word}"));
    }
    pieces
}

/// GPT-2's reversible map from bytes to printable characters, indexed by byte value.
fn byte_to_unicode() -> Vec<char> {
    let printable = |b: u32| {
        (u32::from('!')..=u32::from('~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut next_extra = 256u32;
    (0u32..256)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                next_extra += 1;
                next_extra - 1
            };
            char::from_u32(code).expect("codes below 0x200 are valid chars")
        })
        .collect()
}

/// The token pieces of a conversation. With a tokenizer that carries a checkpoint's chat
/// template, each piece is that template's rendering (what `apply_chat_template` gives, tokenised);
/// otherwise the built-in Qwen-style template applied in token space.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatTemplate;

/// Stands for a response in renders that locate what the template puts after one.
const RESPONSE_MARK: &str = "\u{E000}stepppo-response\u{E000}";

impl ChatTemplate {
    /// A system message alone: `<|im_start|>system\n{text}<|im_end|>\n` built in.
    pub fn system(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        match tok.chat_template() {
            Some(t) => render_ids(tok, t, &[msg("system", text)], false),
            None => Ok(self.message(tok, "system", text)),
        }
    }

    /// A user turn followed by the generation prompt of the assistant:
    /// `<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n` built in.
    pub fn user_turn(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        match tok.chat_template() {
            Some(t) => render_ids(tok, t, &[msg("user", text)], true),
            None => Ok(self.builtin_user_turn(tok, text)),
        }
    }

    /// The first prompt of an episode: the system message, then the user turn that opens the
    /// assistant's response.
    pub fn first_prompt(&self, tok: &Tokenizer, system: &str, user: &str) -> Result<Vec<u32>> {
        match tok.chat_template() {
            Some(t) => render_ids(tok, t, &[msg("system", system), msg("user", user)], true),
            None => {
                let mut ids = self.message(tok, "system", system);
                ids.extend(self.builtin_user_turn(tok, user));
                Ok(ids)
            }
        }
    }

    /// The tokens that follow a sampled `response` in a concatenated context: what closes it
    /// ([`ChatTemplate::close_response`]) and the next user turn with the generation prompt.
    pub fn next_turn(&self, tok: &Tokenizer, response: &[u32], user: &str) -> Result<Vec<u32>> {
        match tok.chat_template() {
            Some(t) => {
                let (_, next) = after_response(t, Some(user))?;
                Ok(tok.encode(strip_eos(tok, response, &next)))
            }
            None => {
                let mut ids = self.close_response(tok, response)?;
                ids.extend(self.builtin_user_turn(tok, user));
                Ok(ids)
            }
        }
    }

    /// What closes `response`: the template's end of an assistant turn, without the end-of-turn
    /// token when the response already ends with it (built in: `<|im_end|>\n`, or `\n`).
    pub fn close_response(&self, tok: &Tokenizer, response: &[u32]) -> Result<Vec<u32>> {
        if let Some(t) = tok.chat_template() {
            let (close, _) = after_response(t, None)?;
            return Ok(tok.encode(strip_eos(tok, response, &close)));
        }
        let mut ids = Vec::new();
        if response.last() != Some(&tok.eos_id()) {
            ids.push(tok.eos_id());
        }
        ids.extend(tok.encode("\n"));
        Ok(ids)
    }

    /// A whole conversation followed by the generation prompt of the assistant: what
    /// `apply_chat_template(messages, add_generation_prompt=True)` gives, tokenised (built in:
    /// each message as `<|im_start|>{role}\n{content}<|im_end|>\n`).
    pub fn conversation(&self, tok: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
        self.conversation_with_tools(tok, messages, &[])
    }

    /// [`ChatTemplate::conversation`] offering the functions `tools` (their JSON schemas as
    /// sent): `apply_chat_template(messages, tools=tools, add_generation_prompt=True)`.
    pub fn conversation_with_tools(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        tools: &[String],
    ) -> Result<Vec<u32>> {
        if let Some(t) = tok.chat_template() {
            return Ok(tok.encode(&t.render(messages, tools, true)?));
        }
        Ok(self.builtin_conversation(tok, &builtin_turns(messages, tools, true)))
    }

    fn builtin_conversation(&self, tok: &Tokenizer, turns: &[(String, String)]) -> Vec<u32> {
        let mut ids: Vec<u32> = turns
            .iter()
            .flat_map(|(role, text)| self.message(tok, role, text))
            .collect();
        ids.push(im_start_id(tok));
        ids.extend(tok.encode("assistant\n"));
        ids
    }

    /// The tokens that follow a sampled `response` (the reply to `history`) when the messages
    /// `trailing` come after it: what closes the response, the trailing messages and the
    /// generation prompt, as the template renders the whole conversation. The response itself
    /// is never re-tokenised, so a context built this way extends the last one. `tools` are the
    /// conversation's function schemas (the template may render later turns differently with
    /// them).
    pub fn after_reply(
        &self,
        tok: &Tokenizer,
        response: &[u32],
        history: &[Message],
        trailing: &[Message],
        tools: &[String],
    ) -> Result<Vec<u32>> {
        let Some(t) = tok.chat_template() else {
            let mut ids = self.close_response(tok, response)?;
            let turns = builtin_turns(trailing, tools, false);
            ids.extend(self.builtin_conversation(tok, &turns));
            return Ok(ids);
        };
        let mut messages = history.to_vec();
        messages.push(msg("assistant", RESPONSE_MARK));
        messages.extend_from_slice(trailing);
        let after = suffix_after_mark(t, &t.render(&messages, tools, true)?)?;
        Ok(tok.encode(strip_eos(tok, response, &after)))
    }

    /// The tokens of the assistant message `reply` as the model samples them after the generation
    /// prompt of `history`: what the template renders for it up to its end of turn, the
    /// end-of-turn token included when the template closes a turn with it (built in: the text,
    /// any tool calls in the Hermes layout, then `<|im_end|>`).
    pub fn reply_ids(
        &self,
        tok: &Tokenizer,
        history: &[Message],
        reply: &Message,
        tools: &[String],
    ) -> Result<Vec<u32>> {
        let Some(t) = tok.chat_template() else {
            let turns = builtin_turns(std::slice::from_ref(reply), &[], false);
            let mut ids = tok.encode(&turns[0].1);
            ids.push(tok.eos_id());
            return Ok(ids);
        };
        let prompt = t.render(history, tools, true)?;
        let mut messages = history.to_vec();
        messages.push(*reply);
        let full = t.render(&messages, tools, false)?;
        let (close, _) = after_response(t, None)?;
        let body = full
            .strip_prefix(prompt.as_str())
            .and_then(|rest| rest.strip_suffix(close.as_str()))
            .ok_or_else(|| TokenizerError::Template {
                path: t.origin().to_string(),
                message: format!(
                    "the assistant message after {} messages does not render as the generation \
                     prompt followed by the reply and {close:?}",
                    history.len()
                ),
            })?;
        let mut ids = tok.encode(body);
        if close.starts_with(tok.decode(&[tok.eos_id()]).as_str()) {
            ids.push(tok.eos_id());
        }
        Ok(ids)
    }

    fn builtin_user_turn(&self, tok: &Tokenizer, text: &str) -> Vec<u32> {
        let mut ids = self.message(tok, "user", text);
        ids.push(im_start_id(tok));
        ids.extend(tok.encode("assistant\n"));
        ids
    }

    fn message(&self, tok: &Tokenizer, role: &str, text: &str) -> Vec<u32> {
        let mut ids = vec![im_start_id(tok)];
        ids.extend(tok.encode(&format!("{role}\n")));
        ids.extend(tok.encode(text));
        ids.push(tok.eos_id());
        ids.extend(tok.encode("\n"));
        ids
    }
}

fn msg<'a>(role: &'a str, content: &'a str) -> Message<'a> {
    Message::text(role, content)
}

/// A conversation as the built-in template sees it: plain (role, text) turns, with tools in the
/// Hermes layout of [`tool_calls`] — the schemas appended to the system message (one is added
/// when the conversation has none), calls written into their assistant turn, and each run of
/// tool results as one user turn. `opening` says whether `messages` start the conversation
/// (only then do the schemas go in).
fn builtin_turns(messages: &[Message], tools: &[String], opening: bool) -> Vec<(String, String)> {
    let mut turns: Vec<(String, String)> = Vec::new();
    let mut rest = messages;
    if opening && !tools.is_empty() {
        let system = match messages.first() {
            Some(m) if m.role == "system" => {
                rest = &messages[1..];
                m.content
            }
            _ => None,
        };
        turns.push((
            "system".into(),
            tool_calls::builtin_tools_system(system, tools),
        ));
    }
    let mut i = 0;
    while i < rest.len() {
        let m = &rest[i];
        if m.role == "tool" {
            let run = rest[i..].iter().take_while(|m| m.role == "tool").count();
            let results = rest[i..i + run]
                .iter()
                .map(|m| m.content.unwrap_or_default());
            turns.push(("user".into(), tool_calls::builtin_tool_results(results)));
            i += run;
            continue;
        }
        let text = if m.tool_calls.is_empty() {
            m.content.unwrap_or_default().to_string()
        } else {
            tool_calls::builtin_call_text(m.content, m.tool_calls)
        };
        turns.push((m.role.to_string(), text));
        i += 1;
    }
    turns
}

fn render_ids(
    tok: &Tokenizer,
    template: &JinjaTemplate,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<Vec<u32>> {
    Ok(tok.encode(&template.render(messages, &[], add_generation_prompt)?))
}

/// What the template renders after an assistant turn: `(close, next)`, where `close` ends the
/// turn when nothing follows and `next` is everything after the turn when a user turn `user`
/// follows (with the generation prompt). `next` is `close` alone when `user` is `None`.
fn after_response(template: &JinjaTemplate, user: Option<&str>) -> Result<(String, String)> {
    let mut messages = vec![
        msg("system", "S"),
        msg("user", "U"),
        msg("assistant", RESPONSE_MARK),
    ];
    let close = suffix_after_mark(template, &template.render(&messages, &[], false)?)?;
    let Some(user) = user else {
        return Ok((close.clone(), close));
    };
    messages.push(msg("user", user));
    let next = suffix_after_mark(template, &template.render(&messages, &[], true)?)?;
    if !next.starts_with(&close) {
        return Err(TokenizerError::Template {
            path: template.origin().to_string(),
            message: format!(
                "an assistant turn ends with {close:?} when last but not before a user turn ({next:?}); \
                 stepppo cannot extend a context in token space with this template"
            ),
        });
    }
    Ok((close, next))
}

fn suffix_after_mark(template: &JinjaTemplate, rendered: &str) -> Result<String> {
    match rendered.split_once(RESPONSE_MARK) {
        Some((_, after)) => Ok(after.to_string()),
        None => Err(TokenizerError::Template {
            path: template.origin().to_string(),
            message: "the template does not render an assistant message's content verbatim".into(),
        }),
    }
}

/// `close` without its leading end-of-turn token when `response` already ended with it.
fn strip_eos<'a>(tok: &Tokenizer, response: &[u32], close: &'a str) -> &'a str {
    if response.last() != Some(&tok.eos_id()) {
        return close;
    }
    close
        .strip_prefix(tok.decode(&[tok.eos_id()]).as_str())
        .unwrap_or(close)
}

/// `<|im_start|>` id; a tokenizer without it gets the text encoded instead.
fn im_start_id(tok: &Tokenizer) -> u32 {
    tok.token_id(IM_START).unwrap_or_else(|| tok.eos_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLES: [&str; 6] = [
        "You are solving the FrozenLake puzzle. Forbid the whole and go to the target.",
        "Turn 1:\nState:\nP_O_\n__G_\nYou have 10 actions left.",
        "<think>go right</think><answer>Right || Down</answer>",
        "unicode ✓ √ 日本語 and emoji 🙂, tabs\tand  double  spaces\n\n",
        "#P_X#\n#_O_#",
        "",
    ];

    #[test]
    fn builtin_round_trips_any_text() {
        let tok = Tokenizer::builtin();
        for s in SAMPLES {
            assert_eq!(tok.decode(&tok.encode(s)), s, "round trip of {s:?}");
        }
    }

    #[test]
    fn builtin_is_small_and_deterministic() {
        let a = Tokenizer::builtin();
        let b = Tokenizer::builtin();
        assert!(
            (1000..=2500).contains(&a.vocab_size()),
            "{}",
            a.vocab_size()
        );
        assert_eq!(a.vocab_size(), b.vocab_size());
        for s in SAMPLES {
            assert_eq!(a.encode(s), b.encode(s));
        }
    }

    #[test]
    fn extra_words_are_whole_tokens_and_builtin_word_ids_stay() {
        let base = Tokenizer::builtin();
        let words: Vec<String> = ["Kalomir", "Zenvor", "the"].map(String::from).to_vec();
        let tok = Tokenizer::builtin_with_words(&words);
        // "the" is built in; each new word adds two pieces (bare and after a space).
        assert_eq!(tok.vocab_size(), base.vocab_size() + 4);
        let special = |id: u32| id >= (base.vocab_size() - SPECIAL_TOKENS.len()) as u32;
        for s in SAMPLES {
            let (ours, built_in) = (tok.encode(s), base.encode(s));
            assert_eq!(ours.len(), built_in.len(), "{s}");
            for (a, b) in ours.into_iter().zip(built_in) {
                // Byte and word ids stay; the special tokens move up by the 4 new pieces.
                assert_eq!(a, if special(b) { b + 4 } else { b }, "{s}");
            }
            assert_eq!(tok.decode(&tok.encode(s)), s);
        }
        let ids = tok.encode("Kalomir the Zenvor Kalomir");
        assert_eq!(ids.len(), 4, "{ids:?}");
        assert!(ids.iter().all(|&id| id != base.encode("K")[0]));
        assert_eq!(tok.decode(&ids), "Kalomir the Zenvor Kalomir");
        assert!(base.encode("Kalomir").len() > 1);
    }

    #[test]
    fn a_texts_pieces_make_it_encode_piece_by_piece() {
        let text = "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\":\"x 42\"}}";
        let pieces = builtin_pieces_of(text);
        for piece in [
            "tool",
            "call",
            "{\"",
            "\":",
            "name",
            "arguments",
            " {\"",
            "\"}}",
        ] {
            let bare = piece.trim_start();
            assert!(pieces.iter().any(|p| p == bare), "{bare:?} in {pieces:?}");
        }
        // A lone character is a byte already (`x`, ` "`); digits and whitespace are not pieces.
        assert!(pieces.iter().all(|p| p.chars().count() > 1), "{pieces:?}");
        assert!(!pieces.iter().any(|p| p.contains('4') || p.contains('\n')));
        let (base, tok) = (Tokenizer::builtin(), Tokenizer::builtin_with_words(&pieces));
        let ids = tok.encode(text);
        assert_eq!(tok.decode(&ids), text);
        let spelled: Vec<String> = ids.iter().map(|&id| tok.decode(&[id])).collect();
        // `<`, `_`, `>`, ` "` (twice), `x` and the digits stay bytes; the rest is one token
        // per piece.
        assert_eq!(spelled.len(), 25, "{spelled:?}");
        assert_eq!(base.encode(text).len(), 46);
    }

    #[test]
    #[should_panic(expected = "letter runs or punctuation runs")]
    fn a_piece_that_mixes_letters_and_punctuation_is_refused() {
        Tokenizer::builtin_with_words(&["tool_call".to_string()]);
    }

    #[test]
    fn template_words_are_whole_tokens_and_grid_cells_are_characters() {
        let tok = Tokenizer::builtin();
        assert_eq!(tok.encode(" FrozenLake").len(), 1);
        assert_eq!(tok.encode("Left").len(), 1);
        assert_eq!(tok.encode(" actions left").len(), 2);
        assert_eq!(tok.encode("P_O_").len(), 4);
        assert_eq!(tok.encode("<answer>Up</answer>").len(), 3);
        assert_eq!(tok.encode(IM_END), vec![tok.eos_id()]);
    }

    #[test]
    fn saved_tokenizer_loads_back_identically() {
        let tok = Tokenizer::builtin();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        tok.save(&path).unwrap();
        let loaded = Tokenizer::from_file(&path).unwrap();
        assert_eq!(loaded.vocab_size(), tok.vocab_size());
        assert_eq!(loaded.eos_id(), tok.eos_id());
        for s in SAMPLES {
            assert_eq!(loaded.encode(s), tok.encode(s));
        }
    }

    #[test]
    fn missing_file_error_names_the_path() {
        let err = Tokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err();
        assert!(err.to_string().contains("/nonexistent/tokenizer.json"));
    }

    #[test]
    fn chat_template_renders_qwen_turns() {
        let tok = Tokenizer::builtin();
        let chat = ChatTemplate;
        let mut ids = chat.system(&tok, "You are a helpful assistant.").unwrap();
        ids.extend(chat.user_turn(&tok, "Hi").unwrap());
        assert_eq!(
            tok.decode(&ids),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let closed = chat
            .close_response(&tok, &tok.encode("<answer>Up</answer>"))
            .unwrap();
        assert_eq!(tok.decode(&closed), "<|im_end|>\n");
        let closed = chat.close_response(&tok, &[tok.eos_id()]).unwrap();
        assert_eq!(tok.decode(&closed), "\n");
    }

    #[test]
    fn episode_contexts_grow_in_token_space() {
        let tok = Tokenizer::builtin();
        let chat = ChatTemplate;
        let mut expected = chat.system(&tok, "S").unwrap();
        expected.extend(chat.user_turn(&tok, "Turn 1").unwrap());
        assert_eq!(chat.first_prompt(&tok, "S", "Turn 1").unwrap(), expected);
        let cut = tok.encode("<answer>Up");
        assert_eq!(
            tok.decode(&chat.next_turn(&tok, &cut, "Turn 2").unwrap()),
            "<|im_end|>\n<|im_start|>user\nTurn 2<|im_end|>\n<|im_start|>assistant\n"
        );
        let mut ended = tok.encode("<answer>Up</answer>");
        ended.push(tok.eos_id());
        assert_eq!(
            tok.decode(&chat.next_turn(&tok, &ended, "Turn 2").unwrap()),
            "\n<|im_start|>user\nTurn 2<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
