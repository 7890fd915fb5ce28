//! stepppo: step-level PPO (StepPO) for LLM agents.
//!
//! The crate is organised along the data flow of a training run:
//! environments ([`env`]) produce text observations; the rollout engine ([`rollout`]) renders
//! them through the tokenizer ([`tokenizer`]) and generates with the model ([`model`]) over a
//! radix-tree KV cache ([`kv`]); every interaction round becomes a [`store::StepRecord`] in a
//! memory-mapped segment store ([`store`]); credit assignment and PPO-family losses live in
//! [`algo`]; the trainer ([`train`]) ties them together under a YAML config ([`config`]);
//! [`view`] serves runs and datasets to a browser; [`interchange`] moves datasets to and from
//! Parquet and OpenAI chat logs.

#![warn(missing_docs)]

pub mod algo;
pub mod config;
pub mod crash;
pub mod device;
pub mod dist;
pub mod env;
pub mod interchange;
pub mod kv;
pub mod model;
pub mod rollout;
pub mod seed;
pub mod serve;
pub mod store;
#[cfg(test)]
mod test_support;
pub mod tokenizer;
pub mod train;
pub mod view;
