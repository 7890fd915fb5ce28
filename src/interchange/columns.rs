//! The Parquet table of a step dataset: one row per [`StepRecord`], its columns named and typed
//! here once for the export ([`RowBuilder`]) and the import ([`records_of_batch`]).
//!
//! Record columns (every field of a record; [`StepInfo`]'s fields flattened to top-level
//! columns so a notebook filters on `success` directly): `traj_id` u64, `group_id` u64,
//! `step_index` u32, `env_tag` string, `seed` u64, `policy_version` u64, `context_len` u32,
//! `obs_ids` list<u32>, `response_ids` list<u32>, `response_logprobs` list<f32>, `reward` f32,
//! `terminated` bool, `truncated` bool, `state_hash` u64, `success` bool, `action_is_valid`
//! bool, `action_is_effective` bool, `format_penalty` f32, `num_actions` u32,
//! `observation_text` string, `action_text` string, `tool_call_error` bool, `context_rebuilt`
//! bool, `critic_state` list<f32>, `admissible_actions` list<string>.
//!
//! Trajectory marks (derived, not read back): `open` bool, `incomplete` bool, `missing_step`
//! u32 (null unless incomplete). Optional derived columns: `obs_text` and `response_text` (the
//! step's new context tokens and response decoded by a tokenizer), `value`, `advantage_raw`,
//! `advantage` and `return` f32 (null for open and incomplete trajectories, which are not scored).
//!
//! The import reads the record columns by name, casting any integer or float type that holds the
//! values (what pandas or polars may write back) and failing on a missing column, a type that
//! does not cast, a null, or a value out of range, naming the column and the row.
//! `tool_call_error`, `context_rebuilt`, `critic_state` and `admissible_actions` may be absent
//! (false, empty).

use std::sync::Arc;

use anyhow::{bail, Context};
use arrow_array::builder::{
    BooleanBuilder, Float32Builder, ListBuilder, StringBuilder, UInt32Builder, UInt64Builder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, UInt32Type, UInt64Type};
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, RecordBatch};
use arrow_cast::cast::{cast_with_options, CastOptions};
use arrow_schema::{DataType, Field, FieldRef, Schema, SchemaRef};

use crate::env::StepInfo;
use crate::store::{Completeness, StepRecord};

/// What a step was scored with by an advantage estimator (`replay --advantages`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScores {
    /// Critic value V(s_t) used (0 for critic-free estimators); column `value`.
    pub value: f32,
    /// The estimator's advantage before whitening and `advantage_clip`.
    pub advantage_raw: f32,
    /// The advantage the loss uses.
    pub advantage: f32,
    /// Return target R_t; column `return`.
    pub ret: f32,
}

/// The optional column sets of an export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extras {
    /// `obs_text`, `response_text`.
    pub text: bool,
    /// `value`, `advantage_raw`, `advantage`, `return`.
    pub scores: bool,
}

const SCORE_COLUMNS: [&str; 4] = ["value", "advantage_raw", "advantage", "return"];

fn list_item(dtype: DataType) -> FieldRef {
    Arc::new(Field::new("item", dtype, false))
}

fn list_of(dtype: DataType) -> DataType {
    DataType::List(list_item(dtype))
}

/// The schema of an export with `extras`.
pub fn schema(extras: Extras) -> SchemaRef {
    use DataType::{Boolean, Float32, UInt32, UInt64, Utf8};
    let required = |name: &str, dtype: DataType| Field::new(name, dtype, false);
    let mut fields = vec![
        required("traj_id", UInt64),
        required("group_id", UInt64),
        required("step_index", UInt32),
        required("env_tag", Utf8),
        required("seed", UInt64),
        required("policy_version", UInt64),
        required("context_len", UInt32),
        required("obs_ids", list_of(UInt32)),
        required("response_ids", list_of(UInt32)),
        required("response_logprobs", list_of(Float32)),
        required("reward", Float32),
        required("terminated", Boolean),
        required("truncated", Boolean),
        required("state_hash", UInt64),
        required("success", Boolean),
        required("action_is_valid", Boolean),
        required("action_is_effective", Boolean),
        required("format_penalty", Float32),
        required("num_actions", UInt32),
        required("observation_text", Utf8),
        required("action_text", Utf8),
        required("tool_call_error", Boolean),
        required("context_rebuilt", Boolean),
        required("critic_state", list_of(Float32)),
        required("admissible_actions", list_of(Utf8)),
        required("open", Boolean),
        required("incomplete", Boolean),
        Field::new("missing_step", UInt32, true),
    ];
    if extras.text {
        fields.push(required("obs_text", Utf8));
        fields.push(required("response_text", Utf8));
    }
    if extras.scores {
        fields.extend(SCORE_COLUMNS.map(|name| Field::new(name, Float32, true)));
    }
    Arc::new(Schema::new(fields))
}

type IdList = ListBuilder<UInt32Builder>;
type FloatList = ListBuilder<Float32Builder>;
type StringList = ListBuilder<StringBuilder>;

fn id_list() -> IdList {
    ListBuilder::new(UInt32Builder::new()).with_field(list_item(DataType::UInt32))
}

fn float_list() -> FloatList {
    ListBuilder::new(Float32Builder::new()).with_field(list_item(DataType::Float32))
}

fn string_list() -> StringList {
    ListBuilder::new(StringBuilder::new()).with_field(list_item(DataType::Utf8))
}

/// Rows of an export batch, column by column.
pub struct RowBuilder {
    schema: SchemaRef,
    extras: Extras,
    ids: [UInt64Builder; 5],
    u32s: [UInt32Builder; 3],
    token_lists: [IdList; 2],
    float_lists: [FloatList; 2],
    admissible_actions: StringList,
    f32s: [Float32Builder; 2],
    bools: [BooleanBuilder; 9],
    strings: [StringBuilder; 3],
    missing_step: UInt32Builder,
    texts: [StringBuilder; 2],
    scores: [Float32Builder; 4],
    rows: usize,
}

impl RowBuilder {
    pub fn new(extras: Extras) -> Self {
        Self {
            schema: schema(extras),
            extras,
            ids: Default::default(),
            u32s: Default::default(),
            token_lists: [id_list(), id_list()],
            float_lists: [float_list(), float_list()],
            admissible_actions: string_list(),
            f32s: Default::default(),
            bools: Default::default(),
            strings: Default::default(),
            missing_step: UInt32Builder::new(),
            texts: Default::default(),
            scores: Default::default(),
            rows: 0,
        }
    }

    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Appends one step; `text` (decoded new context and response) and `scores` fill the
    /// optional columns when the builder has them.
    pub fn push(
        &mut self,
        r: &StepRecord,
        marks: Completeness,
        text: Option<(String, String)>,
        scores: Option<StepScores>,
    ) {
        let info = &r.info;
        for (b, v) in self.ids.iter_mut().zip([
            r.traj_id,
            r.group_id,
            r.seed,
            r.policy_version,
            r.state_hash,
        ]) {
            b.append_value(v);
        }
        for (b, v) in self
            .u32s
            .iter_mut()
            .zip([r.step_index, r.context_len, info.num_actions])
        {
            b.append_value(v);
        }
        for (b, ids) in self
            .token_lists
            .iter_mut()
            .zip([&r.obs_ids, &r.response_ids])
        {
            b.values().append_slice(ids);
            b.append(true);
        }
        for (b, v) in self
            .float_lists
            .iter_mut()
            .zip([&r.response_logprobs, &r.critic_state])
        {
            b.values().append_slice(v);
            b.append(true);
        }
        for action in &r.admissible_actions {
            self.admissible_actions.values().append_value(action);
        }
        self.admissible_actions.append(true);
        for (b, v) in self.f32s.iter_mut().zip([r.reward, info.format_penalty]) {
            b.append_value(v);
        }
        for (b, v) in self.bools.iter_mut().zip([
            r.terminated,
            r.truncated,
            info.success,
            info.action_is_valid,
            info.action_is_effective,
            info.tool_call_error,
            info.context_rebuilt,
            marks.open,
            marks.missing_step.is_some(),
        ]) {
            b.append_value(v);
        }
        for (b, v) in
            self.strings
                .iter_mut()
                .zip([&r.env_tag, &info.observation_text, &info.action_text])
        {
            b.append_value(v);
        }
        self.missing_step.append_option(marks.missing_step);
        if self.extras.text {
            let (obs, response) = text.unwrap_or_default();
            self.texts[0].append_value(obs);
            self.texts[1].append_value(response);
        }
        if self.extras.scores {
            let values = scores.map(|s| [s.value, s.advantage_raw, s.advantage, s.ret]);
            for (i, b) in self.scores.iter_mut().enumerate() {
                b.append_option(values.map(|v| v[i]));
            }
        }
        self.rows += 1;
    }

    /// The rows pushed since the last call, as one batch in the schema's column order.
    pub fn finish(&mut self) -> anyhow::Result<RecordBatch> {
        let [traj, group, seed, version, hash] = &mut self.ids;
        let [step, context, actions] = &mut self.u32s;
        let [obs, response] = &mut self.token_lists;
        let [logprobs, critic] = &mut self.float_lists;
        let [reward, penalty] = &mut self.f32s;
        let [terminated, truncated, success, valid, effective, tool_error, rebuilt, open, incomplete] =
            &mut self.bools;
        let [env_tag, observation, action] = &mut self.strings;
        let mut columns: Vec<ArrayRef> = vec![
            Arc::new(traj.finish()),
            Arc::new(group.finish()),
            Arc::new(step.finish()),
            Arc::new(env_tag.finish()),
            Arc::new(seed.finish()),
            Arc::new(version.finish()),
            Arc::new(context.finish()),
            Arc::new(obs.finish()),
            Arc::new(response.finish()),
            Arc::new(logprobs.finish()),
            Arc::new(reward.finish()),
            Arc::new(terminated.finish()),
            Arc::new(truncated.finish()),
            Arc::new(hash.finish()),
            Arc::new(success.finish()),
            Arc::new(valid.finish()),
            Arc::new(effective.finish()),
            Arc::new(penalty.finish()),
            Arc::new(actions.finish()),
            Arc::new(observation.finish()),
            Arc::new(action.finish()),
            Arc::new(tool_error.finish()),
            Arc::new(rebuilt.finish()),
            Arc::new(critic.finish()),
            Arc::new(self.admissible_actions.finish()),
            Arc::new(open.finish()),
            Arc::new(incomplete.finish()),
            Arc::new(self.missing_step.finish()),
        ];
        if self.extras.text {
            columns.extend(
                self.texts
                    .iter_mut()
                    .map(|b| Arc::new(b.finish()) as ArrayRef),
            );
        }
        if self.extras.scores {
            columns.extend(
                self.scores
                    .iter_mut()
                    .map(|b| Arc::new(b.finish()) as ArrayRef),
            );
        }
        self.rows = 0;
        Ok(RecordBatch::try_new(self.schema.clone(), columns)?)
    }
}

/// One batch's columns, cast to the record types; errors name the column and the file row
/// (`first_row` is the file row of the batch's first row).
struct Columns<'a> {
    batch: &'a RecordBatch,
    first_row: u64,
}

impl Columns<'_> {
    /// Column `name` cast to `dtype`, with no nulls (`None` when absent and `optional`).
    fn get(
        &self,
        name: &str,
        dtype: &DataType,
        optional: bool,
    ) -> anyhow::Result<Option<ArrayRef>> {
        let Some(column) = self.batch.column_by_name(name) else {
            if optional {
                return Ok(None);
            }
            bail!("column `{name}` is missing (expected {dtype})");
        };
        let found = column.data_type().clone();
        let options = CastOptions {
            safe: false,
            ..CastOptions::default()
        };
        let cast = cast_with_options(column, dtype, &options)
            .with_context(|| format!("column `{name}`: {found} does not convert to {dtype}"))?;
        self.no_nulls(name, &cast)?;
        if let DataType::List(_) = dtype {
            self.no_nulls(
                &format!("{name} (an element)"),
                cast.as_list::<i32>().values(),
            )?;
        }
        Ok(Some(cast))
    }

    fn no_nulls(&self, name: &str, array: &ArrayRef) -> anyhow::Result<()> {
        if array.null_count() == 0 {
            return Ok(());
        }
        let at = (0..array.len()).find(|&i| array.is_null(i)).unwrap_or(0);
        match name.contains("element") {
            true => bail!("column `{name}` holds a null"),
            false => bail!("column `{name}`, row {}: null", self.first_row + at as u64),
        }
    }

    fn primitive<T: ArrowPrimitiveType>(
        &self,
        name: &str,
        optional: bool,
    ) -> anyhow::Result<Option<ArrayRef>> {
        self.get(name, &T::DATA_TYPE, optional)
    }

    fn values<T: ArrowPrimitiveType>(&self, name: &str) -> anyhow::Result<Vec<T::Native>> {
        let column = self.primitive::<T>(name, false)?.expect("required");
        Ok(column.as_primitive::<T>().values().to_vec())
    }

    fn bools(&self, name: &str, optional: bool) -> anyhow::Result<Vec<bool>> {
        match self.get(name, &DataType::Boolean, optional)? {
            Some(c) => Ok(c.as_boolean().iter().map(|b| b.unwrap_or(false)).collect()),
            None => Ok(vec![false; self.batch.num_rows()]),
        }
    }

    fn strings(&self, name: &str) -> anyhow::Result<Vec<String>> {
        let column = self.get(name, &DataType::Utf8, false)?.expect("required");
        Ok(column
            .as_string::<i32>()
            .iter()
            .map(|s| s.unwrap_or_default().to_string())
            .collect())
    }

    /// An optional list<string> column (empty lists when absent).
    fn string_lists(&self, name: &str) -> anyhow::Result<Vec<Vec<String>>> {
        let Some(column) = self.get(name, &list_of(DataType::Utf8), true)? else {
            return Ok(vec![Vec::new(); self.batch.num_rows()]);
        };
        let list = column.as_list::<i32>();
        let values = list.values().as_string::<i32>();
        Ok(list
            .offsets()
            .windows(2)
            .map(|w| {
                (w[0]..w[1])
                    .map(|i| values.value(i as usize).to_string())
                    .collect()
            })
            .collect())
    }

    fn lists<T: ArrowPrimitiveType>(
        &self,
        name: &str,
        optional: bool,
    ) -> anyhow::Result<Vec<Vec<T::Native>>> {
        let Some(column) = self.get(name, &list_of(T::DATA_TYPE), optional)? else {
            return Ok(vec![Vec::new(); self.batch.num_rows()]);
        };
        let list = column.as_list::<i32>();
        let values = list.values().as_primitive::<T>().values();
        Ok(list
            .offsets()
            .windows(2)
            .map(|w| values[w[0] as usize..w[1] as usize].to_vec())
            .collect())
    }
}

/// The records of one batch of an imported file (`first_row`: the file row of its first row).
pub fn records_of_batch(batch: &RecordBatch, first_row: u64) -> anyhow::Result<Vec<StepRecord>> {
    let c = Columns { batch, first_row };
    let u64s = |name| c.values::<UInt64Type>(name);
    let u32s = |name| c.values::<UInt32Type>(name);
    let f32s = |name| c.values::<Float32Type>(name);
    let (traj, group, seed, version, hash) = (
        u64s("traj_id")?,
        u64s("group_id")?,
        u64s("seed")?,
        u64s("policy_version")?,
        u64s("state_hash")?,
    );
    let (step, context, actions) = (
        u32s("step_index")?,
        u32s("context_len")?,
        u32s("num_actions")?,
    );
    let (reward, penalty) = (f32s("reward")?, f32s("format_penalty")?);
    let obs = c.lists::<UInt32Type>("obs_ids", false)?;
    let response = c.lists::<UInt32Type>("response_ids", false)?;
    let logprobs = c.lists::<Float32Type>("response_logprobs", false)?;
    let critic = c.lists::<Float32Type>("critic_state", true)?;
    let mut admissible = c.string_lists("admissible_actions")?.into_iter();
    let bools = |name| c.bools(name, false);
    let (terminated, truncated) = (bools("terminated")?, bools("truncated")?);
    let (success, valid, effective) = (
        bools("success")?,
        bools("action_is_valid")?,
        bools("action_is_effective")?,
    );
    let tool_error = c.bools("tool_call_error", true)?;
    let rebuilt = c.bools("context_rebuilt", true)?;
    let env_tag = c.strings("env_tag")?;
    let observation = c.strings("observation_text")?;
    let action = c.strings("action_text")?;
    let mut out = Vec::with_capacity(batch.num_rows());
    let columns = obs.into_iter().zip(response).zip(logprobs).zip(critic);
    for (i, (((obs_ids, response_ids), response_logprobs), critic_state)) in columns.enumerate() {
        out.push(StepRecord {
            traj_id: traj[i],
            group_id: group[i],
            step_index: step[i],
            env_tag: env_tag[i].clone(),
            seed: seed[i],
            policy_version: version[i],
            context_len: context[i],
            obs_ids,
            response_ids,
            response_logprobs,
            reward: reward[i],
            terminated: terminated[i],
            truncated: truncated[i],
            state_hash: hash[i],
            info: StepInfo {
                success: success[i],
                action_is_valid: valid[i],
                action_is_effective: effective[i],
                format_penalty: penalty[i],
                num_actions: actions[i],
                observation_text: observation[i].clone(),
                action_text: action[i].clone(),
                tool_call_error: tool_error[i],
                context_rebuilt: rebuilt[i],
            },
            critic_state,
            admissible_actions: admissible.next().unwrap_or_default(),
        });
    }
    Ok(out)
}
