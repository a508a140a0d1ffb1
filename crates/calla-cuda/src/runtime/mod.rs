//! What every launch stands on: the device and its one stream ([`gpu`]), NVRTC and the on-disk
//! kernel cache ([`nvrtc`], [`kernels`]: the sources embedded in the binary), the libraries found at
//! run time ([`probe`]), device memory carved from a few large allocations ([`pool`]), captured
//! decode graphs ([`graph`]) and the kernel variants the launchers pick ([`choices`]).

pub mod choices;
pub mod gpu;
pub mod graph;
pub mod kernels;
pub mod nvrtc;
pub mod pool;
pub mod probe;
pub mod usable_gpu;
