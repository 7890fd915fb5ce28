//! The segment writer's background I/O thread: it writes full buffers to the segment file, in
//! order, while the writer encodes the next ones, and hands each buffer back for reuse.
//!
//! Contract: buffers reach the file in the order they were submitted, each with one
//! `write_all`; after the first failed write nothing more is written (a later buffer would land
//! after a partial one). The failure is kept and returned, with the file's path, by the next
//! [`IoThread::submit`] or [`IoThread::wait`] and by every call after it, so it is never lost;
//! `wait` returns once every submitted buffer is in the file (readers see it). Dropping the
//! handle lets the thread finish the submitted writes and joins it.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{self, Receiver, Sender};

use super::error::StoreError;

/// Buffers that may wait for or be in the I/O thread at once (the writer fills one more).
const MAX_IN_FLIGHT: usize = 3;

/// Handle of one segment file's I/O thread.
#[derive(Debug)]
pub struct IoThread {
    path: PathBuf,
    file: Arc<File>,
    jobs: Option<Sender<Vec<u8>>>,
    /// One reply per submitted buffer: the emptied buffer, or why it was not written.
    replies: Receiver<io::Result<Vec<u8>>>,
    in_flight: usize,
    spare: Vec<Vec<u8>>,
    /// The first write error; every later call returns it.
    failure: Option<io::Error>,
    thread: Option<JoinHandle<()>>,
}

impl IoThread {
    /// Starts the thread that appends buffers to `file` (open for writing at its end).
    pub fn start(path: &Path, file: File) -> Result<Self, StoreError> {
        let file = Arc::new(file);
        let (jobs, inbox) = channel::bounded::<Vec<u8>>(MAX_IN_FLIGHT);
        let (outbox, replies) = channel::unbounded();
        let target = Arc::clone(&file);
        let thread = std::thread::Builder::new()
            .name("stepppo-segment-io".into())
            .spawn(move || write_in_order(&target, &inbox, &outbox))
            .map_err(StoreError::io(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            jobs: Some(jobs),
            replies,
            in_flight: 0,
            spare: Vec::new(),
            failure: None,
            thread: Some(thread),
        })
    }

    /// Queues `full` to be appended to the file and returns an empty buffer to fill next
    /// (a recycled one when available; waits while [`MAX_IN_FLIGHT`] buffers are queued).
    pub fn submit(&mut self, full: Vec<u8>) -> Result<Vec<u8>, StoreError> {
        self.collect_ready();
        self.check()?;
        let capacity = full.capacity();
        let sent = self.jobs.as_ref().map(|jobs| jobs.send(full));
        if !matches!(sent, Some(Ok(()))) {
            return Err(self.stopped());
        }
        self.in_flight += 1;
        if let Some(buffer) = self.spare.pop() {
            return Ok(buffer);
        }
        if self.in_flight < MAX_IN_FLIGHT {
            return Ok(Vec::with_capacity(capacity));
        }
        self.receive_one()?;
        self.check()?;
        Ok(self
            .spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(capacity)))
    }

    /// Waits until every submitted buffer is written.
    pub fn wait(&mut self) -> Result<(), StoreError> {
        while self.in_flight > 0 {
            self.receive_one()?;
        }
        self.check()
    }

    /// The file being written (to sync it after [`IoThread::wait`]).
    pub fn file(&self) -> &File {
        &self.file
    }

    fn collect_ready(&mut self) {
        while let Ok(reply) = self.replies.try_recv() {
            self.take_reply(reply);
        }
    }

    fn receive_one(&mut self) -> Result<(), StoreError> {
        let reply = self.replies.recv().map_err(|_| self.stopped())?;
        self.take_reply(reply);
        Ok(())
    }

    fn take_reply(&mut self, reply: io::Result<Vec<u8>>) {
        self.in_flight -= 1;
        match reply {
            Ok(mut buffer) => {
                buffer.clear();
                self.spare.push(buffer);
            }
            Err(e) => {
                self.failure.get_or_insert(e);
            }
        }
    }

    fn check(&self) -> Result<(), StoreError> {
        match &self.failure {
            None => Ok(()),
            Some(e) => Err(StoreError::Io {
                path: self.path.clone(),
                source: io::Error::new(e.kind(), e.to_string()),
            }),
        }
    }

    fn stopped(&self) -> StoreError {
        StoreError::Io {
            path: self.path.clone(),
            source: io::Error::other("the segment's I/O thread stopped"),
        }
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            // The thread only ends by running out of jobs; a panic in it has nothing to report.
            let _ = thread.join();
        }
    }
}

/// The thread's loop: append each buffer, reply with it emptied or with the error; after an
/// error, reply to every later buffer without writing it.
fn write_in_order(file: &File, inbox: &Receiver<Vec<u8>>, outbox: &Sender<io::Result<Vec<u8>>>) {
    let mut failed = false;
    for buffer in inbox {
        let written = match failed {
            false => (&*file).write_all(&buffer),
            true => Err(io::Error::other(
                "not written after an earlier write failed",
            )),
        };
        failed |= written.is_err();
        if outbox.send(written.map(|()| buffer)).is_err() {
            return;
        }
    }
}
