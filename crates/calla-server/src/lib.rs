//! The OpenAI-compatible server.
