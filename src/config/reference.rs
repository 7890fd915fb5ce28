//! The config reference page, `docs/reference/config.md`, rendered from the JSON Schema that
//! schemars derives from the run config's types ([`Config`] and everything it holds) and from
//! each env's `custom_envs.<tag>.env_config` keys, doc comments included. This module owns the
//! page's layout and intro, and the rule that every key and every value a user writes is
//! described: [`render`] fails, listing what is not, so a config key cannot be added without
//! its documentation. What a key means lives in its doc comment, next to its type and default;
//! `tests/config_reference.rs` compares the page with the committed file.

use std::collections::BTreeMap;

use schemars::{schema_for, JsonSchema};
use serde::de::{self, Deserialize, Deserializer, Visitor};
use serde_json::Value;

use super::{
    AsyncRolloutConfig, CacheConfig, Config, CopyPretrainConfig, CriticConfig, CustomEnv,
    EnvManagerConfig, GatewayConfig, GeneratingArgs, SelfImitationConfig, SftConfig,
    RESUME_OVERRIDABLE,
};
use crate::algo::config::{GigpoConfig, RewardNormalization};
use crate::env::{
    BanditConfig, FrozenLakeConfig, HotpotQaConfig, ProtocolConfig, RemoteConfig, SokobanConfig,
};

/// Where the page lives, relative to the repository root.
pub const PAGE_PATH: &str = "docs/reference/config.md";

/// The command that rewrites the page from the schema.
pub const BLESS_COMMAND: &str = "STEPPPO_BLESS=1 cargo test --test config_reference";

/// The ready configs of `configs/`, each with what it runs.
pub const READY_CONFIGS: &[(&str, &str)] = &[
    (
        "frozenlake_steppo.yaml",
        "the embedded default of `stepppo train`: StepPO on FrozenLake with the asymmetric state \
         critic",
    ),
    (
        "frozenlake_long.yaml",
        "long-horizon FrozenLake (8×8 maps needing 12–30 moves, shaped reward at every move) \
         for the step-credit comparison",
    ),
    (
        "frozenlake_ppo.yaml",
        "token-level PPO (token GAE) on FrozenLake",
    ),
    ("frozenlake_grpo.yaml", "GRPO on FrozenLake"),
    ("frozenlake_gigpo.yaml", "GiGPO on FrozenLake"),
    (
        "frozenlake_remote.yaml",
        "the default's recipe without its state critic (`step_reinforce`) on gymnasium's \
         FrozenLake behind the env bridge (`env_type: remote`)",
    ),
    (
        "frozenlake_gateway.yaml",
        "the default's recipe trained from an outside agent through the OpenAI-compatible \
         gateway",
    ),
    (
        "sokoban_steppo.yaml",
        "StepPO on the state critic, the run that passes 0.5 on seed 42",
    ),
    ("sokoban_starpo_s.yaml", "StarPO-S on Sokoban"),
    ("bandit_grpo.yaml", "GRPO on the two-armed bandit"),
    (
        "textarena_frozen_lake.yaml",
        "TextArena's FrozenLake through the env bridge after an oracle warm start (does not \
         learn yet: docs/experiments/env-hubs.md)",
    ),
    (
        "gem_guess_number.yaml",
        "GEM's GuessTheNumber through the env bridge after an oracle warm start (does not learn \
         yet: docs/experiments/env-hubs.md)",
    ),
    (
        "textworld_tw5.yaml",
        "TextWorld games (5 rooms, held-out validation games) through the env bridge after a \
         walkthrough warm start (does not learn yet: docs/experiments/env-hubs.md)",
    ),
    (
        "hotpotqa_steppo.yaml",
        "search QA from an oracle warm start",
    ),
    (
        "hotpotqa_steppo_searcher.yaml",
        "search QA from a warm start that searches and guesses, the answer left to RL",
    ),
    (
        "hotpotqa_tools_gateway.yaml",
        "search QA in tool mode, trained from an outside tool-calling agent through the gateway",
    ),
    (
        "hotpotqa_tools_searcher_gateway.yaml",
        "the searcher recipe for an outside tool-calling agent: the answer left to RL",
    ),
];

/// The groups of top-level keys, each from its first key (in the order of [`Config`]'s fields)
/// to the next group's: title and intro.
const GROUPS: &[(&str, &str, &str)] = &[
    ("exp_name", "Run", "Name, seed and directory of the run."),
    (
        "max_steps",
        "Schedule",
        "How long the run trains, how often it validates and saves, and the batch sizes.",
    ),
    (
        "pretrain",
        "Model and rollout",
        "The policy, its critic, the prompt layout, the rollout engine, decoding, the warm start \
         and what runs beside the update.",
    ),
    (
        "adv_estimator",
        "Credit assignment",
        "How rewards (and critic values) become advantages, with ROLL's key names.",
    ),
    (
        "ppo_epochs",
        "Policy update",
        "The PPO update: passes and mini-batches, the optimizer, clipping, KL and the extra loss \
         terms.",
    ),
    (
        "train_env_manager",
        "Environments",
        "Which envs the run plays, and in which groups.",
    ),
];

/// Title and intro of the env keys' part of the page.
const ENV_TITLE: &str = "Env keys: `custom_envs.<tag>.env_config`";
const ENV_INTRO: &str = "Each env of `custom_envs` takes its settings in `env_config`: the \
protocol keys, which every env takes and which say how the agent talks to the env, and the \
env's own keys, by `env_type`. A key left out takes the env's default; an unknown key is an \
error that names the env and the key and lists the known ones. `stepppo env play <env_type> \
--set key=value` takes the same keys.";

/// Protocol defaults that are not a value: (env, key, what the default is).
const PROTOCOL_DEFAULT_NOTES: &[(&str, &str, &str)] = &[(
    "sokoban",
    "max_turns",
    "⌈`max_steps` / `max_actions_per_turn`⌉",
)];

/// Why the page could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    /// Keys, values or sections without a doc comment, by dotted key.
    #[error(
        "these config keys or values have no doc comment; add a `///` comment saying what each \
         means, its unit or range and what its default does:\n  {}",
        .0.join("\n  ")
    )]
    Undocumented(Vec<String>),
    /// The schema does not fit the page's layout (a new nested type, a renamed group key, …).
    #[error("config reference layout: {0}")]
    Layout(String),
}

/// The page: intro, contents, one section per group of top-level keys and per nested section,
/// then the env keys. An error when any key or value is undocumented.
pub fn render() -> Result<String, ReferenceError> {
    let mut page = Page::default();
    let config = SchemaDoc::new(schema_for!(Config).to_value(), field_orders());
    page.config_sections(&config)?;
    page.env_sections()?;
    if !page.missing.is_empty() {
        return Err(ReferenceError::Undocumented(page.missing));
    }
    page.finish()
}

/// One row of a key table.
struct Row {
    key: String,
    ty: String,
    default: String,
    meaning: String,
}

/// One heading and what follows it.
struct Section {
    level: usize,
    title: String,
    intro: String,
    rows: Vec<Row>,
}

/// A nested section still to build: the struct's definition name and the dotted paths (with
/// their defaults) that lead to it.
struct Child {
    def: String,
    paths: Vec<(String, Option<Value>)>,
}

impl Child {
    fn title(&self) -> String {
        let keys: Vec<String> = self.paths.iter().map(|(p, _)| code(p)).collect();
        keys.join(", ")
    }
}

/// A root schema with its definitions, and the field order of its structs.
struct SchemaDoc {
    root: Value,
    orders: BTreeMap<String, &'static [&'static str]>,
}

impl SchemaDoc {
    fn new(root: Value, orders: BTreeMap<String, &'static [&'static str]>) -> Self {
        SchemaDoc { root, orders }
    }

    /// The definition named `name` (`$defs`).
    fn def(&self, name: &str) -> Result<&Value, ReferenceError> {
        self.root
            .get("$defs")
            .and_then(|defs| defs.get(name))
            .ok_or_else(|| ReferenceError::Layout(format!("no definition `{name}`")))
    }

    /// `schema` with a `$ref` followed.
    fn resolve<'a>(&'a self, schema: &'a Value) -> &'a Value {
        match ref_name(schema).and_then(|name| self.def(name).ok()) {
            Some(def) => def,
            None => schema,
        }
    }

    /// The properties of struct `def` (named `name`), in the struct's field order.
    fn fields<'a>(
        &'a self,
        name: &str,
        def: &'a Value,
    ) -> Result<Vec<(&'static str, &'a Value)>, ReferenceError> {
        let props = def
            .get("properties")
            .and_then(Value::as_object)
            .ok_or_else(|| ReferenceError::Layout(format!("`{name}` is not a struct")))?;
        let order = self.orders.get(name).ok_or_else(|| {
            ReferenceError::Layout(format!(
                "no field order for `{name}`: add it to `field_orders` in src/config/reference.rs"
            ))
        })?;
        let fields: Vec<(&'static str, &Value)> = order
            .iter()
            .filter_map(|&field| props.get(field).map(|schema| (field, schema)))
            .collect();
        if fields.len() != props.len() {
            return Err(ReferenceError::Layout(format!(
                "the field order of `{name}` does not match its schema's properties"
            )));
        }
        Ok(fields)
    }

    /// The struct a property leads to, with the path suffix (`.<tag>` for a map of structs).
    fn nested(&self, schema: &Value) -> Option<(String, &'static str)> {
        let is_struct = |name: &str| self.def(name).is_ok_and(|d| d.get("properties").is_some());
        if let Some(name) = ref_name(schema).filter(|n| is_struct(n)) {
            return Some((name.to_string(), ""));
        }
        if let Some(name) = non_null(schema).and_then(ref_name).filter(|n| is_struct(n)) {
            return Some((name.to_string(), ""));
        }
        let values = schema.get("additionalProperties")?;
        let name = ref_name(values).filter(|n| is_struct(n))?;
        Some((name.to_string(), ".<tag>"))
    }

    /// The type column: a scalar type, the allowed values or a list of them.
    fn type_text(&self, schema: &Value) -> String {
        if schema.as_bool() == Some(true) {
            return "any".into();
        }
        if let Some(inner) = non_null(schema) {
            return format!("{} or `null`", self.type_text(inner));
        }
        let schema = self.resolve(schema);
        let values = values(schema);
        if !values.is_empty() {
            let names: Vec<String> = values.iter().map(|(name, _)| code(name)).collect();
            return names.join(" \\| ");
        }
        let types: Vec<&str> = match schema.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let nullable = types.contains(&"null");
        let base = types
            .iter()
            .find(|&&t| t != "null")
            .map(|&t| self.scalar_text(t, schema))
            .unwrap_or_else(|| "any".into());
        if nullable {
            format!("{base} or `null`")
        } else {
            base
        }
    }

    fn scalar_text(&self, ty: &str, schema: &Value) -> String {
        match ty {
            "integer" if schema.get("minimum").and_then(Value::as_f64) == Some(0.0) => {
                "integer ≥ 0".into()
            }
            "array" => {
                let item = schema
                    .get("items")
                    .map(|items| self.type_text(items))
                    .unwrap_or_else(|| "any".into());
                let (min, max) = (schema.get("minItems"), schema.get("maxItems"));
                match (min.and_then(Value::as_u64), max.and_then(Value::as_u64)) {
                    (Some(a), Some(b)) if a == b => format!("list of {a} × {item}"),
                    _ => format!("list of {item}"),
                }
            }
            "object" => "map".into(),
            other => other.into(),
        }
    }
}

/// The page being built.
#[derive(Default)]
struct Page {
    sections: Vec<Section>,
    missing: Vec<String>,
}

impl Page {
    /// The groups of top-level keys and their nested sections.
    fn config_sections(&mut self, doc: &SchemaDoc) -> Result<(), ReferenceError> {
        let fields = doc.fields("Config", &doc.root)?;
        let starts: Vec<usize> = GROUPS
            .iter()
            .map(|(first, _, _)| {
                fields
                    .iter()
                    .position(|(name, _)| name == first)
                    .ok_or_else(|| {
                        ReferenceError::Layout(format!(
                            "group key `{first}` is no top-level key of Config"
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        if starts.first() != Some(&0) || starts.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ReferenceError::Layout(
                "GROUPS must start at Config's first field and follow its field order".into(),
            ));
        }
        for (g, &(_, title, intro)) in GROUPS.iter().enumerate() {
            let end = starts.get(g + 1).copied().unwrap_or(fields.len());
            let group = &fields[starts[g]..end];
            let top = [(String::new(), None)];
            let (rows, children) = self.rows(doc, group, &top, &doc.root)?;
            self.sections.push(Section {
                level: 2,
                title: title.into(),
                intro: intro.into(),
                rows,
            });
            for child in children {
                self.struct_section(doc, child, 3)?;
            }
        }
        Ok(())
    }

    /// The section of a nested struct, then its own nested sections.
    fn struct_section(
        &mut self,
        doc: &SchemaDoc,
        child: Child,
        level: usize,
    ) -> Result<(), ReferenceError> {
        let def = doc.def(&child.def)?;
        let title = child.title();
        let mut intro = match description(def) {
            Some(text) => without_own_name(&prose(text), &child.paths[0].0),
            None => {
                self.missing
                    .push(format!("{title} (the doc comment of `{}`)", child.def));
                String::new()
            }
        };
        if child.paths.len() > 1 {
            let others: Vec<String> = child.paths[1..].iter().map(|(p, _)| code(p)).collect();
            let verb = if others.len() == 1 { "takes" } else { "take" };
            intro.push_str(&format!(
                "\n\n{} {verb} the same keys as {}.",
                others.join(", "),
                code(&child.paths[0].0)
            ));
        }
        let fields = doc.fields(&child.def, def)?;
        let (rows, children) = self.rows(doc, &fields, &child.paths, def)?;
        self.sections.push(Section {
            level,
            title,
            intro,
            rows,
        });
        for grandchild in children {
            self.struct_section(doc, grandchild, (level + 1).min(4))?;
        }
        Ok(())
    }

    /// Rows of `fields` of the struct `owner`, reached by `paths` (dotted prefix and the
    /// default the parent gives the struct), and the nested structs they lead to.
    fn rows(
        &mut self,
        doc: &SchemaDoc,
        fields: &[(&'static str, &Value)],
        paths: &[(String, Option<Value>)],
        owner: &Value,
    ) -> Result<(Vec<Row>, Vec<Child>), ReferenceError> {
        let mut children: Vec<Child> = Vec::new();
        let mut links: BTreeMap<&str, usize> = BTreeMap::new();
        for &(field, schema) in fields {
            let Some((def, suffix)) = doc.nested(schema) else {
                continue;
            };
            let child_paths = paths.iter().map(|(prefix, parent)| {
                let default = field_default(parent.as_ref(), field, schema);
                (format!("{}{suffix}", join(prefix, field)), default)
            });
            match children.iter().position(|c| c.def == def) {
                Some(i) => {
                    children[i].paths.extend(child_paths);
                    links.insert(field, i);
                }
                None => {
                    children.push(Child {
                        def,
                        paths: child_paths.collect(),
                    });
                    links.insert(field, children.len() - 1);
                }
            }
        }
        let mut rows = Vec::new();
        for &(field, schema) in fields {
            let key = join(&paths[0].0, field);
            let mut meaning = match description(schema) {
                Some(text) => cell(text),
                None => {
                    self.missing.push(key.clone());
                    String::new()
                }
            };
            let (ty, default) = match links.get(field) {
                Some(&i) => {
                    let title = children[i].title();
                    let link = format!("[{title}](#{})", slug(&title));
                    let ty = if non_null(schema).is_some() {
                        format!("section {link} or `null`")
                    } else if schema.get("additionalProperties").is_some() {
                        format!("map: tag → {link}")
                    } else {
                        format!("section {link}")
                    };
                    let default = if required(owner, field, schema) {
                        "required".into()
                    } else if schema.get("default").is_none() {
                        "unset".into()
                    } else {
                        "see the section".into()
                    };
                    (ty, default)
                }
                None => {
                    let values = values(doc.resolve(non_null(schema).unwrap_or(schema)));
                    for (name, text) in &values {
                        match text {
                            Some(text) => {
                                meaning.push_str(&format!("<br>{}: {}", code(name), cell(text)))
                            }
                            None => self.missing.push(format!("{key}: value `{name}`")),
                        }
                    }
                    let defaults: Vec<(String, String)> = paths
                        .iter()
                        .map(|(prefix, parent)| {
                            let text = match field_default(parent.as_ref(), field, schema) {
                                Some(value) => value_text(&value),
                                None if required(owner, field, schema) => "required".into(),
                                None => "unset".into(),
                            };
                            (join(prefix, field), text)
                        })
                        .collect();
                    (doc.type_text(schema), differing(&defaults))
                }
            };
            rows.push(Row {
                key,
                ty,
                default,
                meaning,
            });
        }
        Ok((rows, children))
    }

    /// The protocol keys, then each env's own keys.
    fn env_sections(&mut self) -> Result<(), ReferenceError> {
        self.sections.push(Section {
            level: 2,
            title: ENV_TITLE.into(),
            intro: ENV_INTRO.into(),
            rows: Vec::new(),
        });
        let envs = env_docs();
        let registry = crate::env::registry();
        if let Some(name) = registry
            .iter()
            .find(|name| !envs.iter().any(|(n, _)| n == *name))
        {
            return Err(ReferenceError::Layout(format!(
                "env `{name}` has no config type in `env_docs` (src/config/reference.rs)"
            )));
        }
        let protocol = SchemaDoc::new(schema_for!(ProtocolConfig).to_value(), field_orders());
        let fields = protocol.fields("ProtocolConfig", &protocol.root)?;
        let defaults: Vec<(&str, Value)> = registry
            .iter()
            .map(|&env| (env, to_value(&ProtocolConfig::default_for(env))))
            .collect();
        let top = [(String::new(), None)];
        let (mut rows, _) = self.rows(&protocol, &fields, &top, &protocol.root)?;
        for row in &mut rows {
            row.default = protocol_default(&row.key, &defaults);
        }
        let intro = match description(&protocol.root) {
            Some(text) => prose(text),
            None => {
                self.missing.push("env_config protocol keys".into());
                String::new()
            }
        };
        self.sections.push(Section {
            level: 3,
            title: "Protocol keys (every env)".into(),
            intro,
            rows,
        });
        for (name, doc) in &envs {
            let title = code(name);
            let intro = match description(&doc.root) {
                Some(text) => prose(text),
                None => {
                    self.missing.push(format!(
                        "{name} env_config (the doc comment of its config type)"
                    ));
                    String::new()
                }
            };
            let type_name = doc
                .root
                .get("title")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let fields = doc.fields(&type_name, &doc.root)?;
            let (rows, children) = self.rows(doc, &fields, &top, &doc.root)?;
            if !children.is_empty() {
                return Err(ReferenceError::Layout(format!(
                    "env `{name}` has a nested section, which the env part does not lay out"
                )));
            }
            self.sections.push(Section {
                level: 3,
                title,
                intro,
                rows,
            });
        }
        Ok(())
    }

    /// The whole text: header, intro, ready configs, contents and the sections.
    fn finish(self) -> Result<String, ReferenceError> {
        let mut seen = BTreeMap::new();
        for section in &self.sections {
            if let Some(other) = seen.insert(slug(&section.title), &section.title) {
                return Err(ReferenceError::Layout(format!(
                    "sections `{other}` and `{}` share an anchor",
                    section.title
                )));
            }
        }
        let mut out = String::new();
        out.push_str(&format!(
            "<!-- Generated from the doc comments of the config types by `{BLESS_COMMAND}`; \
             edit those, not this file. -->\n\n"
        ));
        out.push_str("# Config reference\n\n");
        out.push_str(&format!(
            "*Generated from the doc comments of the config types (`src/config.rs`, \
             `src/algo/config.rs`, `src/env/`) by `{BLESS_COMMAND}`.*\n\n"
        ));
        out.push_str(&intro());
        out.push_str("## Ready configs\n\n");
        for (file, what) in READY_CONFIGS {
            out.push_str(&format!("- [`{file}`](../../configs/{file}): {what}.\n"));
        }
        out.push_str("\n## Contents\n\n");
        for section in &self.sections {
            let indent = "  ".repeat(section.level - 2);
            out.push_str(&format!(
                "{indent}- [{}](#{})\n",
                section.title,
                slug(&section.title)
            ));
        }
        for section in &self.sections {
            out.push_str(&format!(
                "\n{} {}\n\n",
                "#".repeat(section.level),
                section.title
            ));
            if !section.intro.is_empty() {
                out.push_str(&section.intro);
                out.push('\n');
            }
            if section.rows.is_empty() {
                continue;
            }
            if !section.intro.is_empty() {
                out.push('\n');
            }
            out.push_str("| key | type / allowed values | default | meaning |\n");
            out.push_str("|---|---|---|---|\n");
            for row in &section.rows {
                out.push_str(&format!(
                    "| {} | {} | {} | {} |\n",
                    code(&row.key),
                    row.ty,
                    row.default,
                    row.meaning
                ));
            }
        }
        Ok(out.trim_end().to_string() + "\n")
    }
}

/// The paragraphs before the ready configs: the file format, `--set`, `--resume` and the
/// columns of the tables.
fn intro() -> String {
    let resume: Vec<String> = RESUME_OVERRIDABLE.iter().map(|k| code(k)).collect();
    format!(
        "A run config is a YAML file: `stepppo train --config configs/<name>.yaml` (without \
         `--config`, the embedded default `configs/frozenlake_steppo.yaml`). Every section \
         rejects unknown keys, and every error names the file and the dotted key \
         (``x.yaml: key `generating_args.max_new_tokns`: unknown field …``).\n\n\
         `--set a.b=value` overrides any key before the config is read. The value is read as \
         YAML (`--set train_env_manager.tags=[A,B]`, `--set advantage_clip=null`), and a list \
         element is addressed by its index (`--set val_env_manager.tags.0=X`).\n\n\
         `--resume` continues a run with the config saved in it; only {} may change.\n\n\
         Each table gives a key's dotted path, its type or the values it takes, its default \
         (*required*: the config must give it; *unset*: left out or `null`) and what it \
         means.\n\n",
        list(&resume)
    )
}

/// The field order of every struct of the schemas, by definition name: the order of the
/// fields in the source, which the schema's properties (a sorted map) do not keep.
fn field_orders() -> BTreeMap<String, &'static [&'static str]> {
    let mut orders = BTreeMap::new();
    macro_rules! order {
        ($($t:ty),* $(,)?) => {
            $(orders.insert(<$t as JsonSchema>::schema_name().into_owned(), field_names::<$t>());)*
        };
    }
    order!(
        Config,
        CriticConfig,
        GeneratingArgs,
        EnvManagerConfig,
        CustomEnv,
        SftConfig,
        CopyPretrainConfig,
        SelfImitationConfig,
        AsyncRolloutConfig,
        CacheConfig,
        GatewayConfig,
        RewardNormalization,
        GigpoConfig,
        crate::model::LoraSpec,
        ProtocolConfig,
        FrozenLakeConfig,
        SokobanConfig,
        BanditConfig,
        HotpotQaConfig,
        RemoteConfig,
    );
    orders
}

/// Each env's own keys: its registry name and the schema of its config type.
fn env_docs() -> Vec<(&'static str, SchemaDoc)> {
    let doc = |root: schemars::Schema| SchemaDoc::new(root.to_value(), field_orders());
    vec![
        ("frozen_lake", doc(schema_for!(FrozenLakeConfig))),
        ("sokoban", doc(schema_for!(SokobanConfig))),
        ("bandit", doc(schema_for!(BanditConfig))),
        ("hotpotqa", doc(schema_for!(HotpotQaConfig))),
        ("remote", doc(schema_for!(RemoteConfig))),
    ]
}

/// The serialized field names of struct `T`, in source order: what its `Deserialize` hands to
/// `deserialize_struct` (aliases included; they match no property and are skipped).
fn field_names<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
    let mut probe = FieldProbe(None);
    let _ = T::deserialize(&mut probe);
    probe.0.unwrap_or(&[])
}

/// A deserializer that only records the field names a struct asks for, then fails.
struct FieldProbe(Option<&'static [&'static str]>);

impl<'de> Deserializer<'de> for &mut FieldProbe {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        self.0 = Some(fields);
        Err(de::Error::custom("field names recorded"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// The name of the definition a `$ref` points to.
fn ref_name(schema: &Value) -> Option<&str> {
    schema.get("$ref")?.as_str()?.rsplit('/').next()
}

/// The non-null alternative of an `anyOf: [X, null]` (an `Option` of a referenced type).
fn non_null(schema: &Value) -> Option<&Value> {
    let alternatives = schema.get("anyOf")?.as_array()?;
    let is_null = |s: &Value| s.get("type").and_then(Value::as_str) == Some("null");
    match alternatives.as_slice() {
        [a, b] if is_null(b) => Some(a),
        [a, b] if is_null(a) => Some(b),
        _ => None,
    }
}

/// The values an enum-like schema takes, each with its description (`None`: undocumented).
fn values(schema: &Value) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let name = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if let Some(names) = schema.get("enum").and_then(Value::as_array) {
        out.extend(names.iter().map(|v| (name(v), None)));
    }
    for alternative in schema
        .get("oneOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(value) = alternative.get("const") {
            out.push((name(value), description(alternative).map(str::to_string)));
        }
        if let Some(names) = alternative.get("enum").and_then(Value::as_array) {
            out.extend(names.iter().map(|v| (name(v), None)));
        }
    }
    out
}

/// A schema's non-empty description.
fn description(schema: &Value) -> Option<&str> {
    schema
        .get("description")
        .and_then(Value::as_str)
        .filter(|text| !text.trim().is_empty())
}

/// Whether `field` of struct `owner` must be given.
fn required(owner: &Value, field: &str, schema: &Value) -> bool {
    schema.get("x-required").and_then(Value::as_bool) == Some(true)
        || owner
            .get("required")
            .and_then(Value::as_array)
            .is_some_and(|names| names.iter().any(|n| n == field))
}

/// The default of `field`: what the parent's default gives it, else its own, else none. A
/// required key has none.
fn field_default(parent: Option<&Value>, field: &str, schema: &Value) -> Option<Value> {
    if schema.get("x-required").and_then(Value::as_bool) == Some(true) {
        return None;
    }
    parent
        .and_then(|p| p.get(field))
        .or_else(|| schema.get("default"))
        .cloned()
}

/// One default, or the first path's with the others that differ from it.
fn differing(defaults: &[(String, String)]) -> String {
    let first = &defaults[0].1;
    let others: Vec<String> = defaults[1..]
        .iter()
        .filter(|(_, text)| text != first)
        .map(|(key, text)| format!("{}: {text}", code(key)))
        .collect();
    if others.is_empty() {
        first.clone()
    } else {
        format!("{first} ({})", others.join("; "))
    }
}

/// A protocol key's defaults over the envs: the most common one, then the envs that differ.
fn protocol_default(key: &str, defaults: &[(&str, Value)]) -> String {
    let per_env: Vec<(&str, String)> = defaults
        .iter()
        .map(|(env, protocol)| {
            let note = PROTOCOL_DEFAULT_NOTES
                .iter()
                .find(|(e, k, _)| e == env && *k == key)
                .map(|(_, _, note)| note.to_string());
            let text = note.unwrap_or_else(|| {
                protocol
                    .get(key)
                    .map(value_text)
                    .unwrap_or_else(|| "unset".into())
            });
            (*env, text)
        })
        .collect();
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for (_, text) in &per_env {
        match counts.iter_mut().find(|(t, _)| t == text) {
            Some((_, n)) => *n += 1,
            None => counts.push((text.as_str(), 1)),
        }
    }
    let common = counts
        .iter()
        .max_by_key(|(_, n)| *n)
        .map(|(t, _)| t.to_string())
        .unwrap_or_default();
    let others: Vec<String> = per_env
        .iter()
        .filter(|(_, text)| *text != common)
        .map(|(env, text)| format!("{}: {text}", code(env)))
        .collect();
    if others.is_empty() {
        common
    } else {
        format!("{common} ({})", others.join("; "))
    }
}

/// A default as the config would write it.
fn value_text(value: &Value) -> String {
    match value {
        Value::Null => "unset".into(),
        Value::Object(map) if map.is_empty() => "`{}`".into(),
        Value::Object(_) => "see the section".into(),
        Value::String(s) if s.is_empty() => "`\"\"`".into(),
        other => code(&yaml(other)),
    }
}

/// `value` in YAML flow style.
fn yaml(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => number(n),
        Value::String(s) => s.clone(),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(yaml).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(map) => {
            let items: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{k}: {}", yaml(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

/// A number as written: integers as they are, an `f32` by its shortest form (a default of
/// `0.2f32` reaches JSON as 0.20000000298023224), floats with a fraction part.
fn number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let x = n.as_f64().unwrap_or(f64::NAN);
    let narrow = x as f32;
    let text = if f64::from(narrow) == x {
        narrow.to_string()
    } else {
        x.to_string()
    };
    if text.contains(['.', 'e', 'N', 'i']) {
        text
    } else {
        format!("{text}.0")
    }
}

fn to_value<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// `text` without a leading `` `key`: `` (a struct's doc naming its own key), capitalised.
fn without_own_name(text: &str, key: &str) -> String {
    match text.strip_prefix(&format!("{}: ", code(key))) {
        Some(rest) => {
            let mut chars = rest.chars();
            chars
                .next()
                .map(|first| first.to_uppercase().chain(chars).collect())
                .unwrap_or_default()
        }
        None => text.to_string(),
    }
}

/// `prefix.field`, or `field` at the top.
fn join(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_string()
    } else {
        format!("{prefix}.{field}")
    }
}

/// `text` as inline code.
fn code(text: &str) -> String {
    format!("`{text}`")
}

/// `a`, `b` and `c`.
fn list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// A doc comment as Markdown paragraphs: the lines of a paragraph joined, rustdoc's links
/// (`` [`X`] ``) made plain code.
fn prose(text: &str) -> String {
    let paragraphs: Vec<String> = text
        .split("\n\n")
        .map(|p| {
            let joined: Vec<&str> = p.lines().map(str::trim).collect();
            plain_links(&joined.join(" "))
        })
        .filter(|p| !p.is_empty())
        .collect();
    paragraphs.join("\n\n")
}

/// A doc comment as one table cell: paragraphs separated by line breaks, pipes escaped.
fn cell(text: &str) -> String {
    prose(text).replace('|', "\\|").replace("\n\n", "<br><br>")
}

/// `` [`X`] `` (a rustdoc link) becomes `` `X` ``.
fn plain_links(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("[`") {
        let after = &rest[start + 1..];
        let end = after.find("`]").filter(|&e| !after[1..e].contains('`'));
        match end {
            Some(end) if !after[end + 2..].starts_with('(') => {
                out.push_str(&rest[..start]);
                out.push_str(&after[..end + 1]);
                rest = &after[end + 2..];
            }
            _ => {
                out.push_str(&rest[..start + 2]);
                rest = &rest[start + 2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// GitHub's anchor of a heading: lower case, letters, digits, `-` and `_` kept, spaces made
/// `-`, everything else dropped.
fn slug(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_names_follow_the_source() {
        let names = field_names::<CacheConfig>();
        assert_eq!(
            names,
            [
                "prefix_cache",
                "kv_slots",
                "prefill_attention",
                "cascade_attention"
            ]
        );
    }

    #[test]
    fn numbers_read_as_written() {
        let n = |v: Value| match v {
            Value::Number(n) => number(&n),
            _ => unreachable!(),
        };
        assert_eq!(n(to_value(&0.2f32)), "0.2");
        assert_eq!(n(to_value(&1e-4f64)), "0.0001");
        assert_eq!(n(to_value(&1.0f32)), "1.0");
        assert_eq!(n(to_value(&65536usize)), "65536");
    }

    #[test]
    fn links_become_code_and_anchors_match_github() {
        assert_eq!(
            plain_links("see [`A::b`] and [x](y)"),
            "see `A::b` and [x](y)"
        );
        assert_eq!(slug("`custom_envs.<tag>`"), "custom_envstag");
        assert_eq!(
            slug("`train_env_manager`, `val_env_manager`"),
            "train_env_manager-val_env_manager"
        );
    }

    #[test]
    fn an_undocumented_key_is_named() {
        let mut page = Page::default();
        let root = serde_json::json!({
            "type": "object",
            "properties": {"documented": {"type": "integer", "description": "Yes."},
                           "bare": {"type": "string", "enum": ["a"]}},
            "required": ["bare"],
        });
        let doc = SchemaDoc::new(
            root,
            BTreeMap::from([("T".to_string(), &["documented", "bare"][..])]),
        );
        let fields = doc.fields("T", &doc.root).unwrap();
        let top = [(String::new(), None)];
        let (rows, _) = page.rows(&doc, &fields, &top, &doc.root).unwrap();
        assert_eq!(page.missing, ["bare", "bare: value `a`"]);
        assert_eq!(rows[1].default, "required");
    }
}
