//! A dataset written in a staging directory beside its destination (`DEST.importing`) and renamed
//! into place only when complete, so an import that fails leaves no half-written dataset. The
//! destination must not exist; a staging directory left by a killed import is removed first.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use crate::store::{DatasetWriter, StepRecord, WriterOptions};

pub struct StagedDataset {
    writer: Option<DatasetWriter>,
    staging: PathBuf,
    dest: PathBuf,
}

impl StagedDataset {
    pub fn create(dest: &Path, opts: WriterOptions) -> anyhow::Result<Self> {
        if dest.exists() {
            bail!(
                "{} exists: an import writes a new dataset (remove it, or choose another --out)",
                dest.display()
            );
        }
        let mut name = dest.file_name().unwrap_or_default().to_os_string();
        name.push(".importing");
        let staging = dest.with_file_name(name);
        if staging.exists() {
            std::fs::remove_dir_all(&staging)
                .with_context(|| format!("removing the stale {}", staging.display()))?;
        }
        let writer = DatasetWriter::create(&staging, opts)?;
        Ok(Self {
            writer: Some(writer),
            staging,
            dest: dest.to_path_buf(),
        })
    }

    pub fn append(&mut self, record: &StepRecord) -> anyhow::Result<()> {
        let writer = self.writer.as_mut().expect("present until commit");
        writer.append(record)?;
        Ok(())
    }

    /// Seals the dataset and moves it to its destination.
    pub fn commit(mut self) -> anyhow::Result<()> {
        self.writer.take().expect("present until commit").seal()?;
        std::fs::rename(&self.staging, &self.dest).with_context(|| {
            format!(
                "renaming {} to {}",
                self.staging.display(),
                self.dest.display()
            )
        })
    }
}

impl Drop for StagedDataset {
    /// An import dropped before [`StagedDataset::commit`] failed: its records go.
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            drop(writer);
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}
