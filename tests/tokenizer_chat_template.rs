//! A checkpoint's own chat template (`tests/fixtures/hf/chat`, made by
//! `scripts/make_hf_fixtures.py`): rendered with minijinja it gives the text and ids of
//! transformers' `apply_chat_template` for every prefix of a conversation, and the token-space
//! pieces the rollout appends (first prompt, response close, next turn) add up to those ids.

use std::path::{Path, PathBuf};

use stepppo::tokenizer::{ChatTemplate, Message, Tokenizer};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/chat")
}

struct Case {
    messages: Vec<(String, String)>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            messages: c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    (
                        m["role"].as_str().unwrap().to_string(),
                        m["content"].as_str().unwrap().to_string(),
                    )
                })
                .collect(),
            add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
            text: c["text"].as_str().unwrap().to_string(),
            ids: c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect(),
        })
        .collect()
}

fn find(cases: &[Case], n: usize, gen: bool) -> &Case {
    cases
        .iter()
        .find(|c| c.messages.len() == n && c.add_generation_prompt == gen)
        .unwrap()
}

fn render(tok: &Tokenizer, case: &Case) -> String {
    let messages: Vec<Message> = case
        .messages
        .iter()
        .map(|(role, content)| Message::text(role, content))
        .collect();
    tok.chat_template()
        .unwrap()
        .render(&messages, &[], case.add_generation_prompt)
        .unwrap()
}

#[test]
fn renders_what_apply_chat_template_renders() {
    let tok = Tokenizer::from_dir(&fixture()).unwrap();
    let cases = cases();
    assert_eq!(cases.len(), 6);
    for case in &cases {
        let text = render(&tok, case);
        assert_eq!(text, case.text);
        assert_eq!(tok.encode(&text), case.ids, "{text:?}");
    }
}

#[test]
fn token_space_pieces_add_up_to_apply_chat_template_ids() {
    let tok = Tokenizer::from_dir(&fixture()).unwrap();
    let cases = cases();
    let chat = ChatTemplate;
    let opening = find(&cases, 2, true);
    let (system, user) = (&opening.messages[0].1, &opening.messages[1].1);
    let prompt = chat.first_prompt(&tok, system, user).unwrap();
    assert_eq!(prompt, opening.ids);

    // The template renders the past assistant turn without its <think> part: that is the
    // response whose tokens the model would have produced for this history.
    let mut response = tok.encode("<answer>Right</answer>");
    response.push(tok.eos_id());
    let context = [prompt.clone(), response.clone()].concat();

    let closed = [
        context.clone(),
        chat.close_response(&tok, &response).unwrap(),
    ]
    .concat();
    assert_eq!(closed, find(&cases, 3, false).ids);

    let next_case = find(&cases, 4, true);
    let next = chat
        .next_turn(&tok, &response, &next_case.messages[3].1)
        .unwrap();
    assert_eq!([context, next].concat(), next_case.ids);

    let cut = tok.encode("<answer>Right</answer>");
    let next = chat
        .next_turn(&tok, &cut, &next_case.messages[3].1)
        .unwrap();
    assert_eq!(
        [prompt, cut, next].concat(),
        next_case.ids,
        "a response cut before its end-of-turn token is closed by the template's"
    );
}

#[test]
fn saved_directory_keeps_the_template() {
    let tok = Tokenizer::from_dir(&fixture()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    tok.save_dir(dir.path()).unwrap();
    let back = Tokenizer::from_dir(dir.path()).unwrap();
    for case in &cases() {
        assert_eq!(render(&back, case), case.text);
    }
    assert_eq!(back.eos_id(), tok.eos_id());
}

#[test]
fn template_file_wins_and_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(
        fixture().join("tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role | upper }}]{{ m.content.strip() }}{% endfor %}",
    )
    .unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let text = tok
        .chat_template()
        .unwrap()
        .render(&[Message::text("user", " hi ")], &[], false)
        .unwrap();
    assert_eq!(text, "[USER]hi");

    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )
    .unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja"), "{err}");
}

#[test]
fn builtin_tokenizer_keeps_the_builtin_template() {
    let tok = Tokenizer::builtin();
    assert!(tok.chat_template().is_none());
    let ids = ChatTemplate.first_prompt(&tok, "S", "Hi").unwrap();
    assert_eq!(
        tok.decode(&ids),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// A case of `tests/fixtures/hf/chat-tools/<family>/expected.json` (written by
/// `scripts/make_tool_template_fixtures.py` with transformers): raw JSON kept for the tool
/// schemas and call arguments, whose key order the template's `tojson` must keep.
#[derive(serde::Deserialize)]
struct ToolCase {
    name: String,
    messages: Vec<FixtureMessage>,
    tools: Option<Vec<Box<serde_json::value::RawValue>>>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct FixtureMessage {
    role: String,
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<FixtureCall>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

#[derive(serde::Deserialize)]
struct FixtureCall {
    id: String,
    function: FixtureFunction,
}

#[derive(serde::Deserialize)]
struct FixtureFunction {
    name: String,
    arguments: Box<serde_json::value::RawValue>,
}

#[test]
fn tool_templates_render_what_apply_chat_template_renders() {
    use stepppo::tokenizer::{ToolCall, ToolCallFormat};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/chat-tools");
    for (family, format) in [
        ("qwen2.5", ToolCallFormat::Hermes),
        ("qwen3", ToolCallFormat::Hermes),
        ("llama3.1", ToolCallFormat::Llama3Json),
    ] {
        let dir = root.join(family);
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.tool_call_format(), Ok(format), "{family}");
        #[derive(serde::Deserialize)]
        struct Cases {
            cases: Vec<ToolCase>,
        }
        let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
        let cases: Cases = serde_json::from_str(&text).unwrap();
        assert!(cases.cases.len() >= 6, "{family}");
        for case in &cases.cases {
            let calls: Vec<Vec<ToolCall>> = case
                .messages
                .iter()
                .map(|m| {
                    m.tool_calls
                        .iter()
                        .map(|c| ToolCall::new(&c.id, &c.function.name, c.function.arguments.get()))
                        .collect()
                })
                .collect();
            let messages: Vec<Message> = case
                .messages
                .iter()
                .zip(&calls)
                .map(|(m, calls)| Message {
                    role: &m.role,
                    content: m.content.as_deref(),
                    tool_calls: calls,
                    tool_call_id: m.tool_call_id.as_deref(),
                    name: m.name.as_deref(),
                })
                .collect();
            let tools: Vec<String> = case
                .tools
                .iter()
                .flatten()
                .map(|t| t.get().to_string())
                .collect();
            let label = format!("{family}/{}", case.name);
            let rendered = tok
                .chat_template()
                .unwrap()
                .render(&messages, &tools, case.add_generation_prompt)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            assert_eq!(rendered, case.text, "{label}");
            assert_eq!(tok.encode(&rendered), case.ids, "{label}");
            if case.add_generation_prompt {
                let ids = ChatTemplate
                    .conversation_with_tools(&tok, &messages, &tools)
                    .unwrap();
                assert_eq!(ids, case.ids, "{label}");
            }
        }
    }
}

/// A tool-mode episode built turn by turn in token space (`ToolConversation`: the first prompt,
/// a reply that calls `search`, its tool result, then a reply that calls nothing and the user
/// message after it) adds up to the template's rendering of the whole conversation, for the
/// Qwen 2.5 and Llama 3.1 templates and the built-in one: what an in-process rollout and a
/// warm start's transcripts hold is what a model served through the gateway is shown.
#[test]
fn a_tool_conversation_built_turn_by_turn_is_the_whole_conversations_rendering() {
    use stepppo::tokenizer::tool_calls::{ParsedCall, ParsedReply, ToolCall};
    use stepppo::tokenizer::{Followup, ToolConversation};
    let tools_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/chat-tools");
    let tokenizers = [
        Tokenizer::from_dir(&tools_dir.join("qwen2.5")).unwrap(),
        Tokenizer::from_dir(&tools_dir.join("llama3.1")).unwrap(),
        Tokenizer::builtin(),
    ];
    let tool = r#"{"type":"function","function":{"name":"search","description":"Search.","parameters":{"type":"object","properties":{"query":{"type":"string"}},"required":["query"]}}}"#;
    let tools = vec![tool.to_string()];
    let (system, user) = ("Call a function.", "Question: where was Ada born?");
    let call = ParsedCall {
        name: "search".into(),
        arguments: r#"{"query": "Ada"}"#.into(),
    };
    let result = "Ada was born in Sol.".to_string();
    let (nudge, plain) = ("Call one of the functions offered.", "I do not know.");
    for tok in &tokenizers {
        let (mut conversation, mut ids) =
            ToolConversation::start(tok, system, user, tools.clone()).unwrap();
        let reply = conversation
            .reply_ids(tok, std::slice::from_ref(&call))
            .unwrap();
        let text = tok.decode(&reply);
        let said = ParsedReply::Calls {
            content: None,
            calls: vec![call.clone()],
        };
        ids.extend(&reply);
        let results = [result.clone()];
        let next = conversation
            .after_reply(tok, &reply, (&text, &said), Followup::ToolResults(&results))
            .unwrap();
        ids.extend(next);
        // A reply cut before its end of turn: the template's close follows it.
        let second = tok.encode(plain);
        ids.extend(&second);
        ids.extend(
            conversation
                .after_reply(
                    tok,
                    &second,
                    (plain, &ParsedReply::Content),
                    Followup::User(nudge),
                )
                .unwrap(),
        );

        let calls = [ToolCall::new("call_0_0", "search", &call.arguments)];
        let whole = [
            Message::text("system", system),
            Message::text("user", user),
            Message {
                role: "assistant",
                content: None,
                tool_calls: &calls,
                tool_call_id: None,
                name: None,
            },
            Message {
                role: "tool",
                content: Some(&result),
                tool_calls: &[],
                tool_call_id: Some("call_0_0"),
                name: Some("search"),
            },
            Message::text("assistant", plain),
            Message::text("user", nudge),
        ];
        let expected = ChatTemplate
            .conversation_with_tools(tok, &whole, &tools)
            .unwrap();
        assert_eq!(
            tok.decode(&ids),
            tok.decode(&expected),
            "template {:?}",
            tok.chat_template().map(|t| t.origin().to_string())
        );
        assert_eq!(ids, expected);
    }
}
