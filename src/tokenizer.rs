//! Tokenizer wrapper, built-in vocabulary and chat template (issue 4).
