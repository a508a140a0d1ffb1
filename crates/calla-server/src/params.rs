//! The request fields both endpoints share, validated into what the engine runs with.
//!
//! Sampling defaults come from the checkpoint's generation_config.json when a request leaves a field
//! out (vLLM's order: request, then model default, then OpenAI default), so Qwen's recommended
//! temperature/top-p/top-k apply to clients that send nothing.

use std::collections::BTreeMap;

use calla_engine::SamplingParams;
use calla_model::load::GenerationDefaults;
use serde::Deserialize;
use serde_json::Value as Json;

use crate::errors::ApiError;

pub const MAX_STOP_STRINGS: usize = 16;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields of both /v1/chat/completions and /v1/completions. Unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

/// Validated generation settings of one request.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub sampling: SamplingParams,
    /// None: as much as the context allows (chat) or the endpoint's default (completions).
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub n: usize,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
}

/// Deserialize `T` from the request body's JSON, naming the field that has the wrong type.
pub fn from_body<T: serde::de::DeserializeOwned>(body: &Json) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::bad_request(format!("Invalid request: {inner}"))
        } else {
            ApiError::bad_param(path.clone(), format!("Invalid value for '{path}': {inner}"))
        }
    })
}

fn in_range(name: &str, value: f64, low: f64, high: f64) -> Result<f32, ApiError> {
    if value.is_finite() && (low..=high).contains(&value) {
        Ok(value as f32)
    } else {
        Err(ApiError::bad_param(
            name,
            format!("'{name}' must be between {low} and {high} (got {value})"),
        ))
    }
}

impl SamplingFields {
    pub fn resolve(
        &self,
        defaults: &GenerationDefaults,
        vocab_size: usize,
        max_n: usize,
        random_seed: u64,
    ) -> Result<GenParams, ApiError> {
        let greedy_by_default = defaults.do_sample == Some(false);
        let temperature = match self.temperature {
            Some(t) => in_range("temperature", t, 0.0, 100.0)?,
            None if greedy_by_default => 0.0,
            None => defaults.temperature.unwrap_or(1.0),
        };
        let top_p = match self.top_p {
            Some(p) if p > 0.0 => in_range("top_p", p, 0.0, 1.0)?,
            Some(p) => {
                return Err(ApiError::bad_param(
                    "top_p",
                    format!("'top_p' must be in (0, 1] (got {p})"),
                ))
            }
            None => defaults.top_p.unwrap_or(1.0),
        };
        let top_k = match self.top_k {
            // vLLM and llama.cpp spell "disabled" as -1 or 0.
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::bad_param(
                    "top_k",
                    format!("'top_k' must be -1, 0 or positive (got {k})"),
                ))
            }
            None => defaults.top_k.unwrap_or(0) as usize,
        };
        let min_p = match self.min_p {
            Some(p) => in_range("min_p", p, 0.0, 1.0)?,
            None => defaults.min_p.unwrap_or(0.0),
        };
        let presence_penalty = match self.presence_penalty {
            Some(p) => in_range("presence_penalty", p, -2.0, 2.0)?,
            None => defaults.presence_penalty.unwrap_or(0.0),
        };
        let frequency_penalty = match self.frequency_penalty {
            Some(p) => in_range("frequency_penalty", p, -2.0, 2.0)?,
            None => defaults.frequency_penalty.unwrap_or(0.0),
        };
        let repetition_penalty = match self.repetition_penalty {
            Some(p) if p > 0.0 => in_range("repetition_penalty", p, 0.0, 10.0)?,
            Some(p) => {
                return Err(ApiError::bad_param(
                    "repetition_penalty",
                    format!("'repetition_penalty' must be positive (got {p})"),
                ))
            }
            None => defaults.repetition_penalty.unwrap_or(1.0),
        };
        let mut logit_bias = Vec::new();
        for (key, bias) in self.logit_bias.iter().flatten() {
            let id: u32 = key
                .trim()
                .parse()
                .ok()
                .filter(|&id| (id as usize) < vocab_size)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "logit_bias",
                        format!("logit_bias key '{key}' is not a token id below {vocab_size}"),
                    )
                })?;
            let bias = in_range("logit_bias", *bias, -100.0, 100.0)?;
            logit_bias.push((id, bias));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => Some(("max_completion_tokens", m)),
            (None, Some(m)) => Some(("max_tokens", m)),
            (None, None) => None,
        };
        let max_tokens = match max_tokens {
            Some((_, m)) if m >= 1 => Some(m as usize),
            Some((name, m)) => {
                return Err(ApiError::bad_param(
                    name,
                    format!("'{name}' must be at least 1 (got {m})"),
                ))
            }
            None => None,
        };
        let stop: Vec<String> = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(list)) => list.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_param(
                "stop",
                format!("at most {MAX_STOP_STRINGS} stop strings"),
            ));
        }
        let n = match self.n {
            None => 1,
            Some(n) if n >= 1 && n as usize <= max_n => n as usize,
            Some(n) => {
                return Err(ApiError::bad_param(
                    "n",
                    format!("'n' must be between 1 and {max_n} (got {n})"),
                ))
            }
        };
        Ok(GenParams {
            sampling: SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
                // OpenAI's seed is an int64; its bits are the Philox key.
                seed: self.seed.map_or(random_seed, |s| s as u64),
                logit_bias,
            },
            max_tokens,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            n,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            stream: self.stream.unwrap_or(false),
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resolve(body: Json, defaults: &GenerationDefaults) -> Result<GenParams, ApiError> {
        from_body::<SamplingFields>(&body)?.resolve(defaults, 100, 4, 1234)
    }

    #[test]
    fn checkpoint_defaults_fill_what_the_request_leaves_out() {
        let defaults = GenerationDefaults {
            temperature: Some(0.6),
            top_k: Some(20),
            top_p: Some(0.95),
            ..Default::default()
        };
        let p = resolve(json!({"top_p": 0.5, "seed": -1}), &defaults).unwrap();
        assert_eq!(p.sampling.temperature, 0.6);
        assert_eq!(p.sampling.top_k, 20);
        assert_eq!(p.sampling.top_p, 0.5);
        assert_eq!(p.sampling.seed, u64::MAX);
        let p = resolve(json!({}), &GenerationDefaults::default()).unwrap();
        assert_eq!(
            (p.sampling.temperature, p.sampling.top_p, p.sampling.top_k),
            (1.0, 1.0, 0)
        );
        assert_eq!(p.sampling.seed, 1234);
        let greedy = GenerationDefaults {
            do_sample: Some(false),
            temperature: Some(0.7),
            ..Default::default()
        };
        assert_eq!(
            resolve(json!({}), &greedy).unwrap().sampling.temperature,
            0.0
        );
    }

    #[test]
    fn fields_are_validated_with_their_names() {
        let d = GenerationDefaults::default();
        let cases = [
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"temperature": -1}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_k": -5}), "top_k"),
            (json!({"n": 9}), "n"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (
                json!({"max_completion_tokens": -3}),
                "max_completion_tokens",
            ),
            (json!({"logit_bias": {"100": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5": 101}}), "logit_bias"),
            (json!({"presence_penalty": 3}), "presence_penalty"),
            (json!({"stop": 5}), "stop"),
        ];
        for (body, param) in cases {
            let e = resolve(body.clone(), &d).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn stop_max_tokens_and_stream_options() {
        let p = resolve(
            json!({"stop": ["a", "", "b"], "max_tokens": 9, "max_completion_tokens": 5, "n": 2,
                   "logit_bias": {"7": -100}, "stream": true, "stream_options": {"include_usage": true},
                   "ignore_eos": true, "unknown_field": [1, 2]}),
            &GenerationDefaults::default(),
        )
        .unwrap();
        assert_eq!(p.stop, ["a", "b"]);
        assert_eq!(p.max_tokens, Some(5));
        assert_eq!(p.n, 2);
        assert_eq!(p.sampling.logit_bias, vec![(7, -100.0)]);
        assert!(p.stream && p.include_usage && p.ignore_eos);
        let p = resolve(json!({"stop": "x"}), &GenerationDefaults::default()).unwrap();
        assert_eq!(p.stop, ["x"]);
    }
}
