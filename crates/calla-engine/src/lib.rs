//! calla-engine: what every backend implements ([`Backend`]), the backend-neutral sampling rules
//! ([`SamplingParams`]), and the generation loop built on them.

pub mod backend;
pub mod constraint;
pub mod generate;
pub mod prefix_cache;
pub mod sampling;
pub mod scheduler;

pub use backend::{Backend, BatchRow, Selection, Sequence, TokenChoice};
pub use constraint::{TokenConstraint, TokenMask};
pub use sampling::SamplingParams;
