//! The YAML run configuration (issue 7).
