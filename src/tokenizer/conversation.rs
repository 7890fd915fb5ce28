//! A tool-mode episode in token space: the messages so far (system, user, each assistant reply
//! with its calls, the tool results that answer them) and the functions offered, so that each
//! next piece of context is what the chat template renders for the whole conversation, after the
//! tokens actually sampled (never re-tokenised). This is how an episode looks to a model served
//! through the gateway with `tools`, so an in-process rollout, a warm start's transcripts and an
//! outside agent's session render alike.

use super::jinja::Message;
use super::tool_calls::{ParsedCall, ParsedReply, ToolCall};
use super::{ChatTemplate, Result, Tokenizer};

/// What follows an assistant reply.
#[derive(Clone, Copy, Debug)]
pub enum Followup<'a> {
    /// A user message.
    User(&'a str),
    /// One tool message per call of the reply that ran, in order.
    ToolResults(&'a [String]),
}

/// One message, owned (the template reads [`Message`] views of it).
#[derive(Clone, Debug)]
struct Owned {
    role: &'static str,
    content: Option<String>,
    calls: Vec<ToolCall>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

impl Owned {
    fn text(role: &'static str, content: &str) -> Self {
        Self {
            role,
            content: Some(content.to_string()),
            calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    fn view(&self) -> Message<'_> {
        Message {
            role: self.role,
            content: self.content.as_deref(),
            tool_calls: &self.calls,
            tool_call_id: self.tool_call_id.as_deref(),
            name: self.name.as_deref(),
        }
    }
}

/// The messages of a tool-mode episode and the functions it offers.
#[derive(Clone, Debug)]
pub struct ToolConversation {
    tools: Vec<String>,
    messages: Vec<Owned>,
}

impl ToolConversation {
    /// Opens the episode with `system` and `user`, offering `tools` (OpenAI tool JSON); returns
    /// it and the first prompt's tokens, the generation prompt included.
    pub fn start(
        tok: &Tokenizer,
        system: &str,
        user: &str,
        tools: Vec<String>,
    ) -> Result<(Self, Vec<u32>)> {
        let conversation = Self {
            tools,
            messages: vec![Owned::text("system", system), Owned::text("user", user)],
        };
        let ids = ChatTemplate.conversation_with_tools(
            tok,
            &conversation.views(),
            &conversation.tools,
        )?;
        Ok((conversation, ids))
    }

    /// An episode's first prompt: with `tools` (a tool-mode episode), the tool conversation it
    /// opens and its first prompt; without, no conversation and the plain first prompt.
    pub fn open(
        tok: &Tokenizer,
        system: &str,
        user: &str,
        tools: Vec<String>,
    ) -> Result<(Option<Self>, Vec<u32>)> {
        if tools.is_empty() {
            return Ok((None, ChatTemplate.first_prompt(tok, system, user)?));
        }
        let (conversation, ids) = Self::start(tok, system, user, tools)?;
        Ok((Some(conversation), ids))
    }

    fn views(&self) -> Vec<Message<'_>> {
        self.messages.iter().map(Owned::view).collect()
    }

    /// The ids the calls of the coming reply get (`call_<reply>_<i>`).
    fn calls_with_ids(&self, calls: &[ParsedCall]) -> Vec<ToolCall> {
        let reply = self
            .messages
            .iter()
            .filter(|m| m.role == "assistant")
            .count();
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| ToolCall::new(&format!("call_{reply}_{i}"), &c.name, &c.arguments))
            .collect()
    }

    /// The assistant message of a reply: the text before its calls and the calls (a reply
    /// whose calls did not parse is all content).
    fn assistant(&self, text: &str, reply: &ParsedReply) -> Owned {
        let (content, calls) = match reply {
            ParsedReply::Calls { content, calls } => (content.clone(), self.calls_with_ids(calls)),
            ParsedReply::Content | ParsedReply::Malformed { .. } => {
                (Some(text.to_string()), Vec::new())
            }
        };
        Owned {
            role: "assistant",
            content,
            calls,
            tool_call_id: None,
            name: None,
        }
    }

    /// The tokens that follow the sampled `response` (whose text is `text`, found to say
    /// `reply`) when `followup` comes next: what closes the response, the followup and the
    /// generation prompt. Records the reply and the followup in the conversation.
    pub fn after_reply(
        &mut self,
        tok: &Tokenizer,
        response: &[u32],
        (text, reply): (&str, &ParsedReply),
        followup: Followup<'_>,
    ) -> Result<Vec<u32>> {
        let assistant = self.assistant(text, reply);
        let trailing: Vec<Owned> = match followup {
            Followup::User(user) => vec![Owned::text("user", user)],
            Followup::ToolResults(results) => assistant
                .calls
                .iter()
                .zip(results)
                .map(|(call, result)| Owned {
                    role: "tool",
                    content: Some(result.clone()),
                    calls: Vec::new(),
                    tool_call_id: Some(call.id.clone()),
                    name: Some(call.name.clone()),
                })
                .collect(),
        };
        let history = self.views();
        let trailing_views: Vec<Message<'_>> = trailing.iter().map(Owned::view).collect();
        let ids =
            ChatTemplate.after_reply(tok, response, &history, &trailing_views, &self.tools)?;
        self.messages.push(assistant);
        self.messages.extend(trailing);
        Ok(ids)
    }

    /// The tokens of a reply that makes `calls` and says nothing else, as the model samples it
    /// after the current generation prompt (end of turn included): a model-free agent's turn.
    pub fn reply_ids(&self, tok: &Tokenizer, calls: &[ParsedCall]) -> Result<Vec<u32>> {
        let calls = self.calls_with_ids(calls);
        let reply = Message {
            role: "assistant",
            content: None,
            tool_calls: &calls,
            tool_call_id: None,
            name: None,
        };
        ChatTemplate.reply_ids(tok, &self.views(), &reply, &self.tools)
    }
}
