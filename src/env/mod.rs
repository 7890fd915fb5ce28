//! Environments and the agent text protocol (issue 2).
