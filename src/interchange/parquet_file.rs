//! A step dataset as a Parquet file and back ([`export_parquet`], [`import_parquet`]), through
//! arrow-rs. The export streams the dataset's records in file order (the order they were
//! written; sort by `traj_id`, `step_index` for trajectory order) into row groups of at most
//! 131,072 rows and [`ExportOptions::row_group_bytes`], so memory holds one row group plus 16
//! bytes a record for the trajectory marks. The dataset manifest's `metadata` travels in the file's key-value
//! metadata (`stepppo.metadata`) and comes back with the import, which reads one batch at a time.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use serde_json::Value;

use super::columns::{records_of_batch, Extras, RowBuilder, StepScores};
use super::staging::StagedDataset;
use crate::store::{completeness_by_trajectory, Completeness, Dataset, StepRecord, WriterOptions};
use crate::tokenizer::Tokenizer;

/// Key of the file metadata entry holding the dataset manifest's `metadata` map (JSON).
pub const METADATA_KEY: &str = "stepppo.metadata";
/// Key of the file metadata entry naming the dataset the file was exported from.
pub const SOURCE_KEY: &str = "stepppo.source";
/// Rows per batch handed to the writer, and read back per batch.
const BATCH_ROWS: usize = 8192;
/// Rows per row group at most (fewer when [`ExportOptions::row_group_bytes`] is reached first):
/// enough row groups in a large export for readers to split the work and stream it.
const ROW_GROUP_ROWS: usize = 131_072;

/// Page compression of an export.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ParquetCompression {
    /// zstd level 3 (default): the smallest files; every reader named in the docs reads it.
    #[default]
    Zstd,
    /// Snappy: faster, larger files.
    Snappy,
    /// No compression.
    None,
}

impl ParquetCompression {
    fn codec(self) -> Compression {
        match self {
            Self::Zstd => Compression::ZSTD(ZstdLevel::try_new(3).expect("level 3 is valid")),
            Self::Snappy => Compression::SNAPPY,
            Self::None => Compression::UNCOMPRESSED,
        }
    }
}

/// How to export.
pub struct ExportOptions<'a> {
    /// Codec of every page.
    pub compression: ParquetCompression,
    /// A row group is closed once its encoded size reaches this.
    pub row_group_bytes: usize,
    /// Decode each step's new context tokens and its response into `obs_text`/`response_text`.
    pub text: Option<&'a Tokenizer>,
    /// Per (traj_id, step_index) scores for the `value`/`advantage*`/`return` columns; steps
    /// without an entry get nulls.
    pub scores: Option<&'a HashMap<(u64, u32), StepScores>>,
}

impl Default for ExportOptions<'_> {
    fn default() -> Self {
        Self {
            compression: ParquetCompression::default(),
            row_group_bytes: 64 << 20,
            text: None,
            scores: None,
        }
    }
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSummary {
    /// Records written, one row each.
    pub rows: u64,
    /// Row groups in the file.
    pub row_groups: usize,
    /// Size of the written file in bytes.
    pub bytes: u64,
}

/// Writes every readable record of `dataset` to the Parquet file `out` (through a temporary file
/// beside it, renamed into place when complete).
pub fn export_parquet(
    dataset: &Dataset,
    out: &Path,
    opts: &ExportOptions<'_>,
) -> anyhow::Result<ExportSummary> {
    let marks = completeness_by_trajectory(dataset)?;
    let extras = Extras {
        text: opts.text.is_some(),
        scores: opts.scores.is_some(),
    };
    let props = WriterProperties::builder()
        .set_compression(opts.compression.codec())
        .set_max_row_group_bytes(Some(opts.row_group_bytes.max(1)))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_key_value_metadata(Some(vec![
            KeyValue::new(
                METADATA_KEY.into(),
                serde_json::to_string(&dataset.manifest().metadata)?,
            ),
            KeyValue::new(SOURCE_KEY.into(), dataset.dir().display().to_string()),
        ]))
        .build();
    let partial = partial_path(out);
    let written = write_rows(dataset, &partial, props, &marks, extras, opts);
    let (rows, row_groups) = match written {
        Ok(done) => done,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    std::fs::rename(&partial, out)
        .with_context(|| format!("renaming {} to {}", partial.display(), out.display()))?;
    Ok(ExportSummary {
        rows,
        row_groups,
        bytes: std::fs::metadata(out)?.len(),
    })
}

/// Streams the records of `dataset` into the Parquet file `path`; returns rows and row groups.
fn write_rows(
    dataset: &Dataset,
    path: &Path,
    props: WriterProperties,
    marks: &HashMap<u64, Completeness>,
    extras: Extras,
    opts: &ExportOptions<'_>,
) -> anyhow::Result<(u64, usize)> {
    let mut rows = RowBuilder::new(extras);
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut writer = ArrowWriter::try_new(file, rows.schema().clone(), Some(props))?;
    let mut written = 0u64;
    for view in dataset.records() {
        let record = view.to_record()?;
        let text = opts.text.map(|tok| {
            (
                tok.decode(&record.obs_ids),
                tok.decode(&record.response_ids),
            )
        });
        let scores = opts
            .scores
            .and_then(|s| s.get(&(record.traj_id, record.step_index)).copied());
        let traj_marks = marks.get(&record.traj_id).copied().unwrap_or_default();
        rows.push(&record, traj_marks, text, scores);
        if rows.rows() == BATCH_ROWS {
            writer.write(&rows.finish()?)?;
        }
        written += 1;
    }
    if rows.rows() > 0 {
        writer.write(&rows.finish()?)?;
    }
    let meta = writer.close()?;
    Ok((written, meta.row_groups().len()))
}

fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

/// How to import.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Token ids must be below this (the tokenizer the records are meant for); `None`: the
    /// vocabulary size the file's dataset metadata records, when it records one.
    pub vocab_size: Option<usize>,
    /// Segment size of the new dataset (`None`: the store's default).
    pub roll_bytes: Option<u64>,
}

/// What an import wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportSummary {
    /// Records written to the new dataset, one per row.
    pub records: u64,
    /// Distinct `traj_id`s among them.
    pub trajectories: u64,
    /// Inputs left out, each with why (chat import without `--strict`).
    pub skipped: Vec<String>,
}

/// Reads the Parquet file `path` (as [`export_parquet`] writes it) into a new dataset at `out`.
/// Any bad column or value fails the import and leaves no dataset behind.
pub fn import_parquet(
    path: &Path,
    out: &Path,
    opts: &ImportOptions,
) -> anyhow::Result<ImportSummary> {
    let at = |e: anyhow::Error| e.context(path.display().to_string());
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| anyhow::anyhow!("{}: not a Parquet file: {e}", path.display()))?;
    let metadata =
        file_metadata(builder.metadata().file_metadata().key_value_metadata()).map_err(at)?;
    let vocab_size = opts.vocab_size.or_else(|| recorded_vocab_size(&metadata));
    let mut writer_opts = WriterOptions {
        metadata,
        ..WriterOptions::default()
    };
    if let Some(roll) = opts.roll_bytes {
        writer_opts.roll_bytes = roll;
    }
    writer_opts.metadata.insert(
        "import".into(),
        serde_json::json!({"format": "parquet", "from": path.display().to_string()}),
    );
    let mut staged = StagedDataset::create(out, writer_opts)?;
    let reader = builder.with_batch_size(BATCH_ROWS).build()?;
    let mut summary = ImportSummary::default();
    let mut trajectories = HashSet::new();
    for batch in reader {
        let batch = batch.map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let records = records_of_batch(&batch, summary.records).map_err(at)?;
        for (i, record) in records.iter().enumerate() {
            let row = summary.records + i as u64;
            check_record(record, vocab_size)
                .with_context(|| format!("{}: row {row}", path.display()))?;
            trajectories.insert(record.traj_id);
            staged.append(record)?;
        }
        summary.records += records.len() as u64;
    }
    staged.commit()?;
    summary.trajectories = trajectories.len() as u64;
    Ok(summary)
}

/// The dataset metadata an export stored in the file (empty when the file has none).
fn file_metadata(
    entries: Option<&Vec<KeyValue>>,
) -> anyhow::Result<std::collections::BTreeMap<String, Value>> {
    let Some(text) = entries
        .into_iter()
        .flatten()
        .find(|kv| kv.key == METADATA_KEY)
        .and_then(|kv| kv.value.as_deref())
    else {
        return Ok(Default::default());
    };
    serde_json::from_str(text)
        .with_context(|| format!("file metadata `{METADATA_KEY}` is not a JSON object"))
}

fn recorded_vocab_size(metadata: &std::collections::BTreeMap<String, Value>) -> Option<usize> {
    let size = metadata.get("tokenizer")?.get("vocab_size")?.as_u64()?;
    usize::try_from(size).ok()
}

/// What a record must hold to be stored and trained on.
pub fn check_record(record: &StepRecord, vocab_size: Option<usize>) -> anyhow::Result<()> {
    if record.response_logprobs.len() != record.response_ids.len() {
        bail!(
            "{} response log-probs for {} response tokens",
            record.response_logprobs.len(),
            record.response_ids.len()
        );
    }
    let Some(vocab) = vocab_size else {
        return Ok(());
    };
    for (column, ids) in [
        ("obs_ids", &record.obs_ids),
        ("response_ids", &record.response_ids),
    ] {
        if let Some((k, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            bail!("column `{column}`, element {k}: token id {id} is outside the tokenizer's {vocab} ids");
        }
    }
    Ok(())
}
