//! Atomic checkpoint directories of a run.
//!
//! A checkpoint is written into `<run>/ckpt-<step>.tmp/` (safetensors for weights and optimizer
//! moments, JSON for the trainer state: step, RNG states, env seed counters), every file is
//! fsynced, the directory is renamed to `<run>/ckpt-<step>/`, and the pointer file
//! `<run>/ckpt-latest` (holding the directory name) is replaced atomically. A crash leaves at
//! worst a `.tmp` directory, which readers ignore. Tensors are checked to be finite before anything
//! is written: a checkpoint is never made from NaN/Inf weights. This module owns the on-disk
//! layout; which tensors and state go in is the trainer's business.

use candle_core::{DType, Tensor};
use serde::{de::DeserializeOwned, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Name of the pointer file naming the newest complete checkpoint.
pub const LATEST: &str = "ckpt-latest";

/// Errors of checkpoint writing and reading; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A tensor to save holds NaN or Inf, so nothing was written.
    #[error("{path}: tensor `{name}` is not finite; checkpoint not written")]
    NonFinite {
        /// The checkpoint's temporary directory.
        path: PathBuf,
        /// Name of the non-finite tensor.
        name: String,
    },
    /// A JSON file does not (de)serialize, or the path holds no checkpoint.
    #[error("{path}: {msg}")]
    Format {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A tensor operation failed (checking tensors for finiteness).
    #[error("{path}: {source}")]
    Candle {
        /// The checkpoint directory being written.
        path: PathBuf,
        /// candle's error.
        source: candle_core::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn candle_err(path: &Path) -> impl FnOnce(candle_core::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Candle {
        path: path.to_path_buf(),
        source,
    }
}

/// Directory name of the checkpoint at `step`.
pub fn dir_name(step: u64) -> String {
    format!("ckpt-{step}")
}

/// Whether every element of `t` is finite (one reduction: 0·x is NaN exactly where x is not finite).
pub fn is_finite(t: &Tensor) -> candle_core::Result<bool> {
    let probe = t
        .to_dtype(DType::F32)?
        .affine(0.0, 0.0)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(probe.is_finite())
}

/// A checkpoint being written; nothing is visible under its final name until [`commit`](Self::commit).
pub struct CheckpointWriter {
    run_dir: PathBuf,
    step: u64,
    tmp: PathBuf,
    committed: bool,
}

impl CheckpointWriter {
    /// The directory a checkpoint of `step` is written in before [`commit`](Self::commit):
    /// where the other ranks of a sharded run write their optimizer blocks.
    pub fn tmp_path(run_dir: &Path, step: u64) -> PathBuf {
        run_dir.join(format!("{}.tmp", dir_name(step)))
    }

    /// Starts `<run>/ckpt-<step>.tmp/`, replacing a stale one left by a crash.
    pub fn begin(run_dir: &Path, step: u64) -> Result<Self, CheckpointError> {
        let tmp = Self::tmp_path(run_dir, step);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        Ok(CheckpointWriter {
            run_dir: run_dir.to_path_buf(),
            step,
            tmp,
            committed: false,
        })
    }

    /// Fails (naming the tensor) unless every tensor is finite; call before writing weights.
    pub fn ensure_finite<'t>(
        &self,
        tensors: impl IntoIterator<Item = (&'t str, &'t Tensor)>,
    ) -> Result<(), CheckpointError> {
        for (name, t) in tensors {
            if !is_finite(t).map_err(candle_err(&self.tmp))? {
                return Err(CheckpointError::NonFinite {
                    path: self.tmp.clone(),
                    name: name.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Writes `<name>.json`.
    pub fn json<T: Serialize>(&self, name: &str, value: &T) -> Result<(), CheckpointError> {
        let path = self.tmp.join(format!("{name}.json"));
        let text = serde_json::to_vec_pretty(value).map_err(|e| CheckpointError::Format {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        self.bytes_at(&path, &text)
    }

    /// The temporary directory, where callers save their files (model directories, optimizer
    /// states); [`commit`](Self::commit) fsyncs everything under it.
    pub fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    fn bytes_at(&self, path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
        std::fs::write(path, bytes).map_err(io_err(path))?;
        sync_file(path)
    }

    /// Renames the directory to `ckpt-<step>` and points `ckpt-latest` at it.
    pub fn commit(mut self) -> Result<PathBuf, CheckpointError> {
        sync_tree(&self.tmp)?;
        let final_dir = self.run_dir.join(dir_name(self.step));
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir).map_err(io_err(&final_dir))?;
        }
        std::fs::rename(&self.tmp, &final_dir).map_err(io_err(&final_dir))?;
        crate::crash::point("checkpoint.renamed");
        let pointer_tmp = self.run_dir.join(format!("{LATEST}.tmp"));
        std::fs::write(&pointer_tmp, dir_name(self.step)).map_err(io_err(&pointer_tmp))?;
        sync_file(&pointer_tmp)?;
        let pointer = self.run_dir.join(LATEST);
        std::fs::rename(&pointer_tmp, &pointer).map_err(io_err(&pointer))?;
        sync_dir(&self.run_dir)?;
        self.committed = true;
        Ok(final_dir)
    }
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if !self.committed {
            // An abandoned write (e.g. non-finite weights) leaves nothing behind; failing to
            // remove it is harmless because readers ignore `.tmp` directories.
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

fn sync_file(path: &Path) -> Result<(), CheckpointError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_err(path))
}

fn sync_tree(dir: &Path) -> Result<(), CheckpointError> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            sync_file(&path)?;
        }
    }
    sync_dir(dir)
}

fn sync_dir(path: &Path) -> Result<(), CheckpointError> {
    // Directory fsync makes the rename durable on Linux; other platforms may refuse to open a
    // directory, which only weakens durability, not atomicity.
    if let Ok(dir) = File::open(path) {
        dir.sync_all().map_err(io_err(path))?;
    }
    Ok(())
}

/// The newest complete checkpoint of a run: the one `ckpt-latest` names, else the highest
/// `ckpt-<step>` directory; `.tmp` directories are never returned.
pub fn latest(run_dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let pointer = run_dir.join(LATEST);
    if pointer.is_file() {
        let name = std::fs::read_to_string(&pointer).map_err(io_err(&pointer))?;
        let dir = run_dir.join(name.trim());
        if dir.is_dir() {
            return Ok(Some(dir));
        }
    }
    if !run_dir.is_dir() {
        return Ok(None);
    }
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in std::fs::read_dir(run_dir).map_err(io_err(run_dir))? {
        let path = entry.map_err(io_err(run_dir))?.path();
        let step = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("ckpt-"))
            .and_then(|s| s.parse::<u64>().ok());
        if let Some(step) = step.filter(|_| path.is_dir()) {
            if best.as_ref().is_none_or(|(b, _)| step > *b) {
                best = Some((step, path));
            }
        }
    }
    Ok(best.map(|(_, p)| p))
}

/// Resolves what a user passes as `--checkpoint`: a checkpoint directory, the `ckpt-latest`
/// pointer file, or a run directory (its latest checkpoint).
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    let not_found = || CheckpointError::Format {
        path: path.to_path_buf(),
        msg: "no checkpoint here (expected ckpt-<step>/, ckpt-latest or a run directory)".into(),
    };
    if path.is_file() {
        let name = std::fs::read_to_string(path).map_err(io_err(path))?;
        let dir = path.parent().unwrap_or(Path::new(".")).join(name.trim());
        return if dir.is_dir() {
            Ok(dir)
        } else {
            Err(not_found())
        };
    }
    if path.join("state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    latest(path)?.ok_or_else(not_found)
}

/// Reads `<dir>/<name>.json`.
pub fn load_json<T: DeserializeOwned>(dir: &Path, name: &str) -> Result<T, CheckpointError> {
    let path = dir.join(format!("{name}.json"));
    let text = std::fs::read(&path).map_err(io_err(&path))?;
    serde_json::from_slice(&text).map_err(|e| CheckpointError::Format {
        path,
        msg: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn commit_is_visible_and_round_trips() {
        let run = tempfile::tempdir().unwrap();
        let w = CheckpointWriter::begin(run.path(), 4).unwrap();
        let w_t = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        w.ensure_finite([("w", &w_t)]).unwrap();
        std::fs::create_dir(w.tmp_dir().join("policy")).unwrap();
        std::fs::write(w.tmp_dir().join("policy/x.bin"), [1u8, 2]).unwrap();
        w.json("state", &serde_json::json!({"step": 4})).unwrap();
        let dir = w.commit().unwrap();
        assert_eq!(dir, run.path().join("ckpt-4"));
        assert_eq!(latest(run.path()).unwrap(), Some(dir.clone()));
        assert_eq!(resolve(&run.path().join(LATEST)).unwrap(), dir);
        assert_eq!(resolve(run.path()).unwrap(), dir);
        assert_eq!(std::fs::read(dir.join("policy/x.bin")).unwrap(), vec![1, 2]);
        let s: serde_json::Value = load_json(&dir, "state").unwrap();
        assert_eq!(s["step"], 4);
        assert!(!run.path().join("ckpt-4.tmp").exists());
    }

    #[test]
    fn crashed_tmp_dir_is_ignored() {
        let run = tempfile::tempdir().unwrap();
        let w = CheckpointWriter::begin(run.path(), 2).unwrap();
        w.json("state", &serde_json::json!({"step": 2})).unwrap();
        w.commit().unwrap();
        // A crash in the middle of step 6's checkpoint: its .tmp dir stays, the pointer is old.
        let w = CheckpointWriter::begin(run.path(), 6).unwrap();
        w.json("state", &serde_json::json!({"step": 6})).unwrap();
        std::mem::forget(w);
        assert!(run.path().join("ckpt-6.tmp").is_dir());
        assert_eq!(latest(run.path()).unwrap(), Some(run.path().join("ckpt-2")));
        std::fs::remove_file(run.path().join(LATEST)).unwrap();
        assert_eq!(latest(run.path()).unwrap(), Some(run.path().join("ckpt-2")));
    }

    #[test]
    fn non_finite_weights_are_never_written() {
        let run = tempfile::tempdir().unwrap();
        let w = CheckpointWriter::begin(run.path(), 1).unwrap();
        let bad = Tensor::new(&[1.0f32, f32::NAN], &Device::Cpu).unwrap();
        let err = w.ensure_finite([("bad", &bad)]).unwrap_err();
        assert!(err.to_string().contains("bad"), "{err}");
        drop(w);
        assert!(!run.path().join("ckpt-1.tmp").exists());
        assert_eq!(latest(run.path()).unwrap(), None);
        let inf = Tensor::new(&[f32::INFINITY], &Device::Cpu).unwrap();
        assert!(!is_finite(&inf).unwrap());
    }
}
