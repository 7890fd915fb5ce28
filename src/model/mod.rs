//! Qwen2-family policy and critic models (issue 4).
