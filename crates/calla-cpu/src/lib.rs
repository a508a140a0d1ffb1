//! The CPU reference engine (see crates/calla-cpu/README or docs/architecture.md).
