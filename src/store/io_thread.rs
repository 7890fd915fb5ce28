//! The segment writer's background I/O: full buffers queue up in order and a background thread
//! finishes their frames (the crc, through the writer's `finish` function) and writes them to
//! the segment file while the writer encodes the next ones; emptied buffers come back for reuse.
//!
//! Whoever writes holds the `writing` lock while taking the oldest buffer and writing it, so
//! buffers reach the file in submission order, each with one `write_all`. When the thread falls
//! behind (on a machine with no free core it may not run for a while) the writer writes queued
//! buffers itself, so a busy machine costs no more than writing inline. After the first failed
//! write nothing more is written (a later buffer would land after a partial one); the failure is
//! kept and returned, with the file's path, by the next [`IoThread::submit`] or
//! [`IoThread::wait`] and by every call after it, so it is never lost. `wait` returns once every
//! submitted buffer is in the file (readers see it). Dropping the handle lets the thread write
//! what was submitted and joins it.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use super::error::StoreError;

/// Queued buffers at which the writer writes them itself if the thread is not writing.
const HELP_AT: usize = 2;
/// Queued buffers at which the writer waits for the thread and then writes them itself.
const BLOCK_AT: usize = 6;

/// Bytes to append to the file, with the offsets (in `bytes`) of the frames that `finish` completes.
#[derive(Debug, Default)]
pub struct Batch {
    pub bytes: Vec<u8>,
    pub frames: Vec<u32>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Completes the frames at the given offsets of a buffer before it is written.
pub type Finish = fn(&mut [u8], &[u32]);

#[derive(Debug, Default)]
struct Queue {
    /// Submitted batches not yet taken for writing, oldest first.
    pending: VecDeque<Batch>,
    /// Written batches, emptied, for reuse.
    spare: Vec<Batch>,
    shutdown: bool,
}

#[derive(Debug)]
struct Shared {
    file: File,
    finish: Finish,
    queue: Mutex<Queue>,
    /// Signals the thread that `queue` has work or is shutting down.
    wake: Condvar,
    /// Held while taking a batch from `pending` and writing it; holds the first write error.
    writing: Mutex<Option<io::Error>>,
    failed: AtomicBool,
}

impl Shared {
    /// Writes every pending batch in order; `failure` is the content of the held `writing` lock.
    fn write_pending(&self, failure: &mut Option<io::Error>) {
        loop {
            let Some(mut batch) = self.queue.lock().pending.pop_front() else {
                return;
            };
            if failure.is_none() {
                (self.finish)(&mut batch.bytes, &batch.frames);
                if let Err(e) = (&self.file).write_all(&batch.bytes) {
                    *failure = Some(e);
                    self.failed.store(true, Ordering::Release);
                }
            }
            batch.bytes.clear();
            batch.frames.clear();
            self.queue.lock().spare.push(batch);
        }
    }

    /// The thread's loop: write whatever is queued until shut down with nothing queued.
    fn run(&self) {
        loop {
            {
                let mut queue = self.queue.lock();
                while queue.pending.is_empty() && !queue.shutdown {
                    self.wake.wait(&mut queue);
                }
                if queue.pending.is_empty() {
                    return;
                }
            }
            self.write_pending(&mut self.writing.lock());
        }
    }
}

/// Handle of one segment file's I/O thread.
#[derive(Debug)]
pub struct IoThread {
    path: PathBuf,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl IoThread {
    /// Starts the thread that completes batches with `finish` and appends them to `file` (open
    /// for writing at its end).
    pub fn start(path: &Path, file: File, finish: Finish) -> Result<Self, StoreError> {
        let shared = Arc::new(Shared {
            file,
            finish,
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            writing: Mutex::new(None),
            failed: AtomicBool::new(false),
        });
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("stepppo-segment-io".into())
            .spawn(move || worker.run())
            .map_err(StoreError::io(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            shared,
            thread: Some(thread),
        })
    }

    /// Queues `full` to be finished and appended to the file and returns an empty batch to fill
    /// next (a recycled one when available).
    pub fn submit(&mut self, full: Batch) -> Result<Batch, StoreError> {
        self.check()?;
        let capacities = (full.bytes.capacity(), full.frames.capacity());
        let queued = {
            let mut queue = self.shared.queue.lock();
            queue.pending.push_back(full);
            queue.pending.len()
        };
        self.shared.wake.notify_one();
        if queued >= BLOCK_AT {
            self.shared.write_pending(&mut self.shared.writing.lock());
        } else if queued >= HELP_AT {
            if let Some(mut failure) = self.shared.writing.try_lock() {
                self.shared.write_pending(&mut failure);
            }
        }
        self.check()?;
        let spare = self.shared.queue.lock().spare.pop();
        Ok(spare.unwrap_or_else(|| Batch {
            bytes: Vec::with_capacity(capacities.0),
            frames: Vec::with_capacity(capacities.1),
        }))
    }

    /// Returns once every submitted batch is written (writing what is still queued itself).
    pub fn wait(&mut self) -> Result<(), StoreError> {
        self.shared.write_pending(&mut self.shared.writing.lock());
        self.check()
    }

    /// The file being written (to sync it after [`IoThread::wait`]).
    pub fn file(&self) -> &File {
        &self.shared.file
    }

    fn check(&self) -> Result<(), StoreError> {
        if !self.shared.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let failure = self.shared.writing.lock();
        let (kind, message) = failure
            .as_ref()
            .map_or((io::ErrorKind::Other, String::new()), |e| {
                (e.kind(), e.to_string())
            });
        Err(StoreError::Io {
            path: self.path.clone(),
            source: io::Error::new(kind, message),
        })
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.shared.queue.lock().shutdown = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            // The thread only ends after writing what was queued; it has nothing to report.
            let _ = thread.join();
        }
    }
}
