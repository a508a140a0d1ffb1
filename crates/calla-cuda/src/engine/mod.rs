//! The engine built from the ops: [`backend`] (the `calla_engine::Backend`: upload, graphs, steps,
//! the prompt path's entry), [`decode`] (one token's chain of launches), [`prefill`] and
//! [`prefill_scratch`] (a prompt chunk's batched launches and their buffers), [`sequence`] (a
//! sequence's device state).

pub mod backend;
pub mod decode;
pub mod prefill;
pub mod prefill_scratch;
pub mod sequence;
