//! Unknown request fields: accepted (clients send vendor extensions freely, and a 400 would break
//! them) but logged once per request as a warning naming them, so a field calla does not honour
//! never goes silently ignored.

use serde_json::Value as Json;

/// Fields of /v1/chat/completions calla reads, and pure metadata it accepts without effect (`user`,
/// `metadata`, `store`, `service_tier`, `prompt_cache_key`). Everything else is warned about.
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "logit_bias",
    "ignore_eos",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
];

pub const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "echo",
    "logprobs",
    "suffix",
    "best_of",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "logit_bias",
    "ignore_eos",
    "stream",
    "stream_options",
    "user",
];

/// The top-level fields of `body` not in `known`.
pub fn unknown_fields<'a>(body: &'a Json, known: &[&str]) -> Vec<&'a str> {
    body.as_object()
        .map(|o| {
            o.keys()
                .map(String::as_str)
                .filter(|k| !known.contains(k))
                .collect()
        })
        .unwrap_or_default()
}

/// Log the fields of `body` that `endpoint` ignores.
pub fn warn_unknown_fields(body: &Json, known: &[&str], endpoint: &str) {
    let unknown = unknown_fields(body, known);
    if !unknown.is_empty() {
        tracing::warn!(
            target: "calla::request",
            "{endpoint}: ignoring unsupported field(s): {}",
            unknown.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_only_the_fields_not_known() {
        let body = json!({"model": "m", "messages": [], "frobnicate": 1, "xyz": null});
        assert_eq!(unknown_fields(&body, CHAT_FIELDS), ["frobnicate", "xyz"]);
    }
}
