//! calla-server: the OpenAI-compatible HTTP API.
//!
//! HTTP JSON → request fields (params.rs, validated, OpenAI-shaped errors) → chat template (chat.rs)
//! or raw prompts (completions.rs) → token ids → the engine's queue (generation.rs: one job per
//! choice, a sink that detokenizes and applies stop strings on the engine thread) → reasoning /
//! tool-call parsing → one JSON body or SSE chunks (sse.rs). The engine is whatever `Backend` the
//! caller built (CPU, CUDA); the server only sees the scheduler.
//!
//! Start with [`AppState::new`], bind, [`serve`] (answering 503 until [`AppState::set_ready`]).

pub mod anthropic;
mod anthropic_input;
pub mod auth;
pub mod chat;
mod chat_reply;
pub mod codec;
pub mod completions;
pub mod cors;
pub mod errors;
pub mod generation;
pub mod guard;
pub mod listen;
pub mod load;
pub mod metrics;
pub mod params;
pub mod request;
pub mod responses;
mod responses_input;
pub mod routes;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tokenize;
pub mod tool_filter;
pub mod turn;
pub mod unknown;

pub use codec::{IncrementalText, TextCodec};
pub use errors::ApiError;
pub use listen::{serve, Limits};
pub use load::{load_in_background, load_outcome, start_runtime, RuntimeOptions};
pub use routes::router;
pub use state::{AppState, Runtime, ServerConfig};
