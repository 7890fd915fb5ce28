//! KV slot pool and radix-tree prefix cache (issues 4 and 5).
pub mod radix;
