//! Step datasets to and from the formats of the Python ecosystem: a dataset exported as one
//! Parquet file (one row per step, typed columns: `columns`; written and read back through
//! arrow-rs: `parquet_file`), and an agent's OpenAI chat-format logs imported as steps (`chat`).
//! Imports write a new dataset in a staging directory renamed into place when complete
//! (`staging`), so a failed import leaves nothing behind. The readers and writers stream: memory
//! holds one batch or row group, not the dataset. Usage and the column list for notebooks:
//! `docs/guides/datasets.md`.

mod chat;
mod columns;
mod parquet_file;
mod staging;

pub use chat::{import_chat_jsonl, ChatImportOptions, DEFAULT_CHAT_ENV_TAG};
pub use columns::{schema, Extras, StepScores};
pub use parquet_file::{
    check_record, export_parquet, import_parquet, ExportOptions, ExportSummary, ImportOptions,
    ImportSummary, ParquetCompression, METADATA_KEY, SOURCE_KEY,
};
