//! An env's actions as functions (OpenAI function calling), for the protocol's tool mode
//! (`tools: true`): the function schemas an action space offers, the [`Action`] a call stands
//! for (or why it stands for none), and the call that expresses an action (what the model-free
//! agents answer in tool mode). A search env offers `search(query)` and `answer(answer)`; an env
//! of named actions offers `act(action)` with the names as an enum; a free-text env offers
//! `answer(answer)`. Finding calls in a model's text is the tokenizer's business
//! (`tokenizer::tool_calls`, per template family); this module reads the calls it found.

use serde_json::{json, Map, Value};

use super::{Action, ActionSpace};
use crate::tokenizer::tool_calls::ParsedCall;

/// One function of an action space: its name, what it does, and its single string parameter.
struct Function {
    name: &'static str,
    description: &'static str,
    parameter: &'static str,
}

const SEARCH: Function = Function {
    name: "search",
    description: "Search the documents.",
    parameter: "query",
};
const ANSWER: Function = Function {
    name: "answer",
    description: "Give the final answer.",
    parameter: "answer",
};
const ACT: Function = Function {
    name: "act",
    description: "Take an action.",
    parameter: "action",
};

fn functions(space: &ActionSpace) -> &'static [Function] {
    match space {
        ActionSpace::SearchOrAnswer => &[SEARCH, ANSWER],
        ActionSpace::FreeText => &[ANSWER],
        ActionSpace::Named(_) => &[ACT],
    }
}

/// The names of the functions `space` offers.
pub fn function_names(space: &ActionSpace) -> Vec<&'static str> {
    functions(space).iter().map(|f| f.name).collect()
}

/// The functions `space` offers, each as the JSON text of an OpenAI tool
/// (`{"type": "function", "function": {"name", "description", "parameters"}}`).
pub fn tool_schemas(space: &ActionSpace) -> Vec<String> {
    functions(space)
        .iter()
        .map(|f| {
            let mut parameter = Map::new();
            parameter.insert("type".into(), json!("string"));
            if let ActionSpace::Named(names) = space {
                parameter.insert("enum".into(), json!(names));
            }
            let tool = json!({
                "type": "function",
                "function": {
                    "name": f.name,
                    "description": f.description,
                    "parameters": {
                        "type": "object",
                        "properties": {f.parameter: Value::Object(parameter)},
                        "required": [f.parameter],
                    },
                },
            });
            tool.to_string()
        })
        .collect()
}

/// The action `call` stands for in `space`, or why it stands for none (an unknown function,
/// arguments that are not an object holding the parameter as a non-empty string, an action
/// name not offered).
pub fn call_action(space: &ActionSpace, call: &ParsedCall) -> Result<Action, String> {
    let function = functions(space)
        .iter()
        .find(|f| f.name == call.name)
        .ok_or_else(|| format!("call of unknown function `{}`", call.name))?;
    let arguments: Value = serde_json::from_str(&call.arguments)
        .map_err(|e| format!("`{}` arguments are not JSON: {e}", call.name))?;
    let value = arguments
        .get(function.parameter)
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| {
            format!(
                "`{}` needs a non-empty string argument `{}`",
                call.name, function.parameter
            )
        })?;
    match (space, function.name) {
        (ActionSpace::Named(names), _) => names
            .iter()
            .find(|n| n.eq_ignore_ascii_case(value))
            .map(|n| Action::Move(n.clone()))
            .ok_or_else(|| format!("`{value}` is not one of {}", names.join(", "))),
        (_, "search") => Ok(Action::Search(value.to_string())),
        _ => Ok(Action::Answer(value.to_string())),
    }
}

/// The call that expresses `action`. A search query or an answer starts with a space, as in
/// the text protocol's tags: a copied word is then the same token as the one it copies (the env
/// trims it).
pub fn action_call(action: &Action) -> ParsedCall {
    let (function, value) = match action {
        Action::Move(name) => (&ACT, name.clone()),
        Action::Search(query) => (&SEARCH, format!(" {query}")),
        Action::Answer(text) => (&ANSWER, format!(" {text}")),
    };
    let mut arguments = Map::new();
    arguments.insert(function.parameter.into(), Value::String(value));
    ParsedCall {
        name: function.name.to_string(),
        arguments: Value::Object(arguments).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn each_space_offers_its_functions_and_reads_their_calls() {
        let search = ActionSpace::SearchOrAnswer;
        assert_eq!(function_names(&search), ["search", "answer"]);
        let schema: Value = serde_json::from_str(&tool_schemas(&search)[0]).unwrap();
        assert_eq!(schema["function"]["parameters"]["required"][0], "query");
        assert_eq!(
            call_action(&search, &call("search", r#"{"query": " Torivi"}"#)),
            Ok(Action::Search("Torivi".into()))
        );
        let moves = ActionSpace::Named(vec!["Left".into(), "Up".into()]);
        let schema: Value = serde_json::from_str(&tool_schemas(&moves)[0]).unwrap();
        assert_eq!(
            schema["function"]["parameters"]["properties"]["action"]["enum"],
            json!(["Left", "Up"])
        );
        assert_eq!(
            call_action(&moves, &call("act", r#"{"action": "up"}"#)),
            Ok(Action::Move("Up".into()))
        );
    }

    #[test]
    fn a_call_that_stands_for_no_action_says_why() {
        let search = ActionSpace::SearchOrAnswer;
        let err = |c: ParsedCall| call_action(&search, &c).unwrap_err();
        assert!(err(call("act", "{}")).contains("unknown function `act`"));
        assert!(err(call("search", "[1]")).contains("`query`"));
        assert!(err(call("search", r#"{"query": 3}"#)).contains("`query`"));
        assert!(err(call("answer", r#"{"answer": "  "}"#)).contains("non-empty"));
        assert!(err(call("answer", "{")).contains("not JSON"));
        let moves = ActionSpace::Named(vec!["Left".into()]);
        let e = call_action(&moves, &call("act", r#"{"action": "Jump"}"#)).unwrap_err();
        assert!(e.contains("not one of Left"), "{e}");
    }

    #[test]
    fn an_actions_call_reads_back_as_the_action() {
        let search = ActionSpace::SearchOrAnswer;
        for action in [Action::Search("a b".into()), Action::Answer("1948".into())] {
            assert_eq!(call_action(&search, &action_call(&action)), Ok(action));
        }
    }
}
