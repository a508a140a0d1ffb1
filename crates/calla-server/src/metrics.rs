//! Prometheus metrics, in the text exposition format, without a global recorder (several servers can
//! live in one test process). Names follow vLLM's (`calla:` instead of `vllm:`), each with a
//! `model_name` label.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use calla_engine::prefix_cache::PrefixCacheStats;

/// Seconds; a latency histogram's upper bounds.
const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

pub struct Histogram {
    bounds: &'static [f64],
    /// One count per bound (non-cumulative) plus +Inf.
    counts: Vec<AtomicU64>,
    sum: Mutex<f64>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: Mutex::new(0.0),
        }
    }

    pub fn observe(&self, value: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        self.counts[slot].fetch_add(1, Ordering::Relaxed);
        *self.sum.lock().unwrap_or_else(|p| p.into_inner()) += value;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bound) in self.bounds.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        cumulative += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
        let sum = *self.sum.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub requests_succeeded: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub queue_time: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            requests_succeeded: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            time_to_first_token: Histogram::new(&LATENCY_BUCKETS),
            inter_token_latency: Histogram::new(&LATENCY_BUCKETS),
            e2e_request_latency: Histogram::new(&LATENCY_BUCKETS),
            queue_time: Histogram::new(&LATENCY_BUCKETS),
        }
    }
}

/// What the scheduler knows at the time of a scrape.
pub struct EngineGauges {
    pub running: usize,
    pub waiting: usize,
    pub prefix_cache: PrefixCacheStats,
}

impl Metrics {
    pub fn render(&self, model_name: &str, engine: Option<EngineGauges>) -> String {
        let labels = format!("model_name=\"{}\"", escape_label(model_name));
        let mut out = String::new();
        let mut scalar = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}"
            );
        };
        let engine = engine.unwrap_or(EngineGauges {
            running: 0,
            waiting: 0,
            prefix_cache: PrefixCacheStats::default(),
        });
        scalar(
            "calla:num_requests_running",
            "gauge",
            "Requests being generated.",
            engine.running as f64,
        );
        scalar(
            "calla:num_requests_waiting",
            "gauge",
            "Requests waiting in the queue.",
            engine.waiting as f64,
        );
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        scalar(
            "calla:prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            count(&self.prompt_tokens),
        );
        scalar(
            "calla:generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            count(&self.generation_tokens),
        );
        scalar(
            "calla:request_success_total",
            "counter",
            "Requests that finished.",
            count(&self.requests_succeeded),
        );
        scalar(
            "calla:request_failure_total",
            "counter",
            "Requests that failed in the engine.",
            count(&self.requests_failed),
        );
        scalar(
            "calla:request_cancelled_total",
            "counter",
            "Requests whose client went away.",
            count(&self.requests_cancelled),
        );
        let cache = engine.prefix_cache;
        scalar(
            "calla:prefix_cache_queries_total",
            "counter",
            "Prefix-cache lookups.",
            cache.queries as f64,
        );
        scalar(
            "calla:prefix_cache_hits_total",
            "counter",
            "Prefix-cache lookups that restored a state.",
            cache.hits as f64,
        );
        scalar(
            "calla:prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens restored from the prefix cache.",
            cache.hit_tokens as f64,
        );
        scalar(
            "calla:prefix_cache_bytes",
            "gauge",
            "Memory held by saved sequence states.",
            cache.bytes as f64,
        );
        scalar(
            "calla:prefix_cache_entries",
            "gauge",
            "Saved sequence states.",
            cache.entries as f64,
        );
        self.time_to_first_token.render(
            &mut out,
            "calla:time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            &labels,
        );
        self.inter_token_latency.render(
            &mut out,
            "calla:inter_token_latency_seconds",
            "Between consecutive generated tokens.",
            &labels,
        );
        self.e2e_request_latency.render(
            &mut out,
            "calla:e2e_request_latency_seconds",
            "From request arrival to its last token.",
            &labels,
        );
        self.queue_time.render(
            &mut out,
            "calla:request_queue_time_seconds",
            "Time spent waiting for the engine.",
            &labels,
        );
        out
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_prometheus_text() {
        let m = Metrics::default();
        m.time_to_first_token.observe(0.003);
        m.time_to_first_token.observe(0.2);
        m.time_to_first_token.observe(500.0);
        m.prompt_tokens.fetch_add(7, Ordering::Relaxed);
        let text = m.render("demo", None);
        assert!(text.contains("calla:prompt_tokens_total{model_name=\"demo\"} 7"));
        assert!(text.contains(
            "calla:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.0025\"} 0"
        ));
        assert!(text.contains(
            "calla:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.005\"} 1"
        ));
        assert!(text.contains(
            "calla:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"0.25\"} 2"
        ));
        assert!(text.contains(
            "calla:time_to_first_token_seconds_bucket{model_name=\"demo\",le=\"+Inf\"} 3"
        ));
        assert!(text.contains("calla:time_to_first_token_seconds_count{model_name=\"demo\"} 3"));
        assert!(text.contains("# TYPE calla:num_requests_waiting gauge"));
    }
}
