//! Top-level command enum; each command group's arguments and printing live in its own file.

mod bench;
mod env;
mod model;
mod plan;
mod serve;
mod store;
mod train;
mod view;

use clap::{Parser, Subcommand};

/// stepppo: step-level PPO for LLM agents.
#[derive(Parser, Debug)]
#[command(name = "stepppo", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a policy (the embedded FrozenLake default without --config).
    Train(train::TrainArgs),
    /// Evaluate a checkpoint on validation seeds.
    Eval(train::EvalArgs),
    /// Supervised warm start (behaviour cloning) from a stored dataset.
    Sft(train::SftArgs),
    /// Draw learning curves of a run directory.
    Plot(train::PlotArgs),
    /// The memory a training update needs, part by part, and the largest forward that fits.
    Plan(plan::PlanArgs),
    /// List environments or play them with a model-free agent.
    #[command(subcommand)]
    Env(env::EnvCommand),
    /// Run envs with a model-free agent and store their steps.
    Collect(store::CollectArgs),
    /// Print, export or re-score a stored step dataset.
    Replay(store::ReplayArgs),
    /// Verify or repair a stored step dataset.
    #[command(subcommand)]
    Dataset(store::DatasetCommand),
    /// Generate text with a model.
    Generate(model::GenerateArgs),
    /// Score a given continuation of a prompt: each token's log-prob (teacher forcing).
    Score(model::ScoreArgs),
    /// Write a freshly initialised HF-format model directory.
    InitModel(model::InitModelArgs),
    /// Fold a PEFT LoRA adapter into its base model and write the merged HF-format directory.
    MergeAdapter(model::MergeAdapterArgs),
    /// Serve a policy over the OpenAI chat-completions API, recording sessions as steps.
    Serve(serve::ServeArgs),
    /// Browse a run or a dataset in the browser (a read-only local web server).
    View(view::ViewArgs),
    /// Quick benchmarks with the built-in model.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

impl Cli {
    pub fn run(self) -> anyhow::Result<()> {
        match self.command {
            Command::Train(a) => train::train(a),
            Command::Eval(a) => train::eval(a),
            Command::Sft(a) => train::sft(a),
            Command::Plot(a) => train::plot(a),
            Command::Plan(a) => plan::plan(a),
            Command::Env(c) => env::run(c),
            Command::Collect(a) => store::collect(a),
            Command::Replay(a) => store::replay(a),
            Command::Dataset(c) => store::dataset(c),
            Command::Generate(a) => model::generate(a),
            Command::Score(a) => model::score(a),
            Command::InitModel(a) => model::init_model(a),
            Command::MergeAdapter(a) => model::merge_adapter(a),
            Command::Serve(a) => serve::serve(a),
            Command::View(a) => view::view(a),
            Command::Bench(c) => bench::run(c),
        }
    }
}
