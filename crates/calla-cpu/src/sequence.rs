//! A sequence's state in the CPU engine: per layer a KV cache or DeltaNet conv + recurrent state, and
//! the number of tokens consumed. A plain value: `snapshot` is a deep copy.

use std::any::Any;

use calla_engine::Sequence;

use crate::attention::KvCache;
use crate::deltanet::DeltaNetState;

#[derive(Debug, Clone)]
pub enum LayerState {
    DeltaNet(DeltaNetState),
    Attention(KvCache),
}

#[derive(Debug, Clone)]
pub struct CpuSequence {
    /// Tokens consumed (the position of the next token).
    pub position: usize,
    /// One per decoder layer, in order.
    pub layers: Vec<LayerState>,
}

impl Sequence for CpuSequence {
    fn len(&self) -> usize {
        self.position
    }
    fn snapshot(&self) -> Box<dyn Sequence> {
        Box::new(self.clone())
    }
    fn byte_size(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::DeltaNet(s) => s.byte_size(),
                LayerState::Attention(c) => c.byte_size(),
            })
            .sum()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
