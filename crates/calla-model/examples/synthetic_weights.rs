//! Time `random_weights` for a preset: `cargo run --release -p calla-model --example synthetic_weights -- cpu-mid q4 [seed]`.

use std::time::Instant;

use calla_model::load::Quant;
use calla_model::synthetic::{preset, random_weights, PRESETS};
use calla_model::weights::stats::weight_stats;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map(String::as_str).unwrap_or("cpu-mid");
    let quant: Quant = args.get(1).map(String::as_str).unwrap_or("q4").parse()?;
    let seed: u64 = args
        .get(2)
        .map(|s| s.parse().map_err(|e| format!("seed: {e}")))
        .transpose()?
        .unwrap_or(0);
    let spec =
        preset(name).ok_or_else(|| format!("unknown preset {name:?} (known: {PRESETS:?})"))?;
    let start = Instant::now();
    let weights = random_weights(&spec, quant, seed);
    let seconds = start.elapsed().as_secs_f64();
    let stats = weight_stats(&spec, &weights);
    println!(
        "{name} {quant}: {:.3} B params, {:.3} GB, {:.1} MB read per token, generated in {seconds:.2} s ({:.2} GB/s)",
        stats.total_params as f64 / 1e9,
        stats.total_bytes as f64 / 1e9,
        stats.bytes_per_token as f64 / 1e6,
        stats.total_bytes as f64 / 1e9 / seconds
    );
    for (format, count) in &stats.formats {
        println!(
            "  {format:<14} {:>6} tensors {:>14} params {:>14} bytes",
            count.matrices, count.params, count.bytes
        );
    }
    Ok(())
}
