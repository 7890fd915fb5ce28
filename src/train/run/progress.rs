//! The live progress bar of a training run: step, latest success and reward, validation success
//! and ETA (indicatif; drawn on stderr only when it is a terminal).

use indicatif::{ProgressBar, ProgressStyle};

/// Progress display of one run.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar over `total` steps starting at `done` (non-zero when resuming).
    pub fn new(total: u64, done: u64) -> Self {
        let bar = ProgressBar::new(total);
        let style = ProgressStyle::with_template(
            "{elapsed_precise} [{wide_bar}] step {pos}/{len} {msg} ETA {eta}",
        )
        .expect("the progress template is valid")
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_position(done);
        Progress { bar }
    }

    /// Advances to `step` and shows the newest figures.
    pub fn update(
        &self,
        step: u64,
        success: f64,
        reward: f64,
        val_success: Option<f64>,
        step_s: f64,
    ) {
        let val = val_success.map_or(String::new(), |v| format!(" val {v:.2}"));
        let msg = format!("success {success:.2} reward {reward:.3}{val} ({step_s:.1}s/step)");
        if self.bar.is_hidden() {
            let elapsed = self.bar.elapsed().as_secs_f64();
            eprintln!(
                "[{elapsed:>7.1}s] step {step}/{}: {msg}",
                self.bar.length().unwrap_or(0)
            );
        }
        self.bar.set_message(msg);
        self.bar.set_position(step);
    }

    /// Prints a line above the bar (warnings, validation results); plain stderr when the bar is
    /// hidden (not a terminal), so logs keep every line.
    pub fn println(&self, line: impl AsRef<str>) {
        if self.bar.is_hidden() {
            eprintln!("{}", line.as_ref());
        } else {
            self.bar.println(line.as_ref());
        }
    }

    /// Leaves the final state on screen.
    pub fn finish(&self) {
        self.bar.finish();
    }
}
