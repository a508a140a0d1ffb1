//! The checkpoint's own chat template, rendered as transformers' `apply_chat_template` renders it.
//!
//! transformers compiles templates in an `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True, extensions=[loopcontrols])` with its own `tojson` (Python `json.dumps`, no HTML
//! escaping), `raise_exception` and `strftime_now`, and renders with `messages`, `tools`, `documents`,
//! `add_generation_prompt`, the tokenizer's special tokens and the caller's template kwargs. minijinja
//! with pycompat (`.startswith`, `.split`, `.items`, …) and the same settings gives the same bytes; the
//! committed renders made by transformers are the test (tests/fixtures/chat/renders.json).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Kwargs, Rest};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::pyjson::{self, PyJsonOptions};

const TEMPLATE_NAME: &str = "chat_template";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{path}: {message}")]
    Load { path: String, message: String },
    #[error("the checkpoint in {0} has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json)")]
    Missing(String),
    #[error("chat template does not compile: {0:#}")]
    Syntax(Error),
    /// The template itself refused the conversation (`raise_exception`), or a value it needed was
    /// missing. A client error: the message says what the template wanted.
    #[error("chat template: {0}")]
    Render(String),
    /// The render ran out of its budget (instructions or output bytes): a runaway template or a
    /// conversation too large for it.
    #[error("chat template: {0}")]
    Budget(String),
}

/// Instructions one render may execute (minijinja fuel). The Qwen3.6 template spends about 100 per
/// message; this allows tens of thousands of messages and stops a loop that never ends in about a
/// second.
pub const DEFAULT_RENDER_FUEL: u64 = 20_000_000;
/// Bytes one render may write.
pub const DEFAULT_MAX_RENDER_BYTES: usize = 64 << 20;

/// What one render takes, as transformers passes it to the template.
#[derive(Debug, Clone, Default)]
pub struct RenderInput<'a> {
    /// Messages in the template's shape (see [`crate::messages::prepare_messages`]).
    pub messages: &'a [Json],
    /// OpenAI tool definitions, passed as given (`{"type": "function", "function": {...}}`).
    pub tools: Option<&'a [Json]>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs` (enable_thinking, preserve_thinking, …); they override special tokens.
    pub kwargs: Option<&'a Map<String, Json>>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    max_output_bytes: usize,
    /// bos_token, eos_token, pad_token, unk_token from tokenizer_config.json.
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The template of a checkpoint directory: `chat_template.jinja` if present (transformers ≥ 4.43 writes
    /// it there), else `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of
    /// which "default" is taken).
    pub fn from_dir(dir: &Path) -> Result<ChatTemplate, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let jinja_path = dir.join("chat_template.jinja");
        for path in [&config_path, &jinja_path] {
            // A FIFO or device under these names would block the read for ever.
            if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
                return Err(TemplateError::Load {
                    path: path.display().to_string(),
                    message: "not a regular file (a FIFO, device or directory)".into(),
                });
            }
        }
        let config: Option<Json> = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(
                serde_json::from_str(&text).map_err(|e| TemplateError::Load {
                    path: config_path.display().to_string(),
                    message: format!("not valid JSON: {e}"),
                })?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(TemplateError::Load {
                    path: config_path.display().to_string(),
                    message: e.to_string(),
                })
            }
        };
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => config
                .as_ref()
                .and_then(template_from_config)
                .ok_or_else(|| TemplateError::Missing(dir.display().to_string()))?,
            Err(e) => {
                return Err(TemplateError::Load {
                    path: jinja_path.display().to_string(),
                    message: e.to_string(),
                })
            }
        };
        let special_tokens = config.as_ref().map(special_tokens_of).unwrap_or_default();
        ChatTemplate::new(source, special_tokens)
    }

    pub fn new(
        source: String,
        special_tokens: BTreeMap<String, String>,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_fuel(Some(DEFAULT_RENDER_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(TemplateError::Syntax)?;
        Ok(ChatTemplate {
            env,
            max_output_bytes: DEFAULT_MAX_RENDER_BYTES,
            special_tokens,
        })
    }

    /// Set the render budget: instructions (minijinja fuel) and output bytes.
    pub fn set_limits(&mut self, fuel: u64, max_output_bytes: usize) {
        self.env.set_fuel(Some(fuel));
        self.max_output_bytes = max_output_bytes;
    }

    pub fn render(&self, input: &RenderInput) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(TemplateError::Syntax)?;
        let mut context: BTreeMap<String, Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        context.insert("messages".into(), Value::from_serialize(input.messages));
        context.insert(
            "tools".into(),
            match input.tools {
                Some(tools) => Value::from_serialize(tools),
                None => Value::from(()),
            },
        );
        context.insert("documents".into(), Value::from(()));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(input.add_generation_prompt),
        );
        if let Some(kwargs) = input.kwargs {
            for (k, v) in kwargs {
                context.insert(k.clone(), Value::from_serialize(v));
            }
        }
        let mut out = BoundedWriter {
            buf: Vec::new(),
            limit: self.max_output_bytes,
            exceeded: false,
        };
        match template.render_captured_to(context, &mut out) {
            Ok(_) => Ok(String::from_utf8(out.buf)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())),
            Err(_) if out.exceeded => Err(TemplateError::Budget(format!(
                "the rendered prompt exceeds {} bytes",
                self.max_output_bytes
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TemplateError::Budget(
                "rendering ran out of its instruction budget (the conversation is too large for \
                 the template, or the template does not terminate)"
                    .into(),
            )),
            Err(e) => Err(TemplateError::Render(describe_render_error(&e))),
        }
    }
}

/// The render's output, refusing writes past `limit`.
struct BoundedWriter {
    buf: Vec<u8>,
    limit: usize,
    exceeded: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(bytes.len()) > self.limit {
            self.exceeded = true;
            return Err(std::io::Error::other("render output limit"));
        }
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn template_from_config(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// Special tokens as the template sees them: plain strings, or `{"content": ...}` AddedToken objects.
fn special_tokens_of(config: &Json) -> BTreeMap<String, String> {
    let mut tokens = BTreeMap::new();
    for key in [
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "cls_token",
        "sep_token",
        "mask_token",
    ] {
        let text = match config.get(key) {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(str::to_owned),
            _ => None,
        };
        if let Some(text) = text {
            tokens.insert(key.to_string(), text);
        }
    }
    tokens
}

/// A message from `raise_exception` is the template's own words; other errors keep minijinja's detail.
fn describe_render_error(e: &Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) if detail.starts_with(RAISED) => {
            detail[RAISED.len()..].to_string()
        }
        _ => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(inner) = source {
                text.push_str(": ");
                text.push_str(&inner.to_string());
                source = inner.source();
            }
            text
        }
    }
}

const RAISED: &str = "raised: ";

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

/// transformers' tojson: `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// with the same positional order.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let json: Json = serde_json::to_value(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: value is not serialisable: {e}"),
        )
    })?;
    let arg = |position: usize, name: &str| -> Result<Option<Value>, Error> {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            return Ok(Some(v));
        }
        Ok(args.get(position).cloned())
    };
    let mut opts = PyJsonOptions::default();
    if let Some(v) = arg(0, "ensure_ascii")? {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = arg(1, "indent")? {
        if let Some(s) = v.as_str() {
            opts.indent = Some(s.to_string());
        } else if let Ok(n) = i64::try_from(v.clone()) {
            // Python: indent=0 still inserts newlines; a negative indent is treated as 0.
            opts.indent = Some(" ".repeat(n.clamp(0, 256) as usize));
        }
    }
    if let Some(v) = arg(2, "separators")? {
        if !v.is_none() {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_owned).unwrap_or_default())
                .collect();
            if parts.len() != 2 {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            }
            opts.separators = Some((parts[0].clone(), parts[1].clone()));
        }
    }
    if let Some(v) = arg(3, "sort_keys")? {
        opts.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(pyjson::dumps_with(&json, &opts)))
}

/// `strftime_now(format)`: the current UTC time through the common strftime directives.
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(secs, &format)))
}

pub(crate) fn strftime(unix_secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') => match chars.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some(other) => {
                    out.push_str("%-");
                    out.push(other);
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), Howard Hinnant's civil_from_days.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: Json) -> Result<String, TemplateError> {
        let template = ChatTemplate::new(source.to_string(), BTreeMap::new())?;
        let messages = messages.as_array().cloned().unwrap_or_default();
        template.render(&RenderInput {
            messages: &messages,
            add_generation_prompt: true,
            ..Default::default()
        })
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel() {
        let started = std::time::Instant::now();
        let err = render(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            json!([{"role": "user", "content": "x"}]),
        )
        .unwrap_err();
        assert!(matches!(err, TemplateError::Budget(_)), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
    }

    #[test]
    fn the_rendered_output_is_capped() {
        let mut template = ChatTemplate::new(
            "{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}".into(),
            BTreeMap::new(),
        )
        .unwrap();
        template.set_limits(DEFAULT_RENDER_FUEL, 4 << 20);
        let err = template.render(&RenderInput::default()).unwrap_err();
        assert!(matches!(err, TemplateError::Budget(_)), "{err}");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let out = render(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ messages[0].x | tojson(separators=(',', ':')) }}",
            json!([{"role": "user", "x": [1, 2.0, "<&é>"]}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"x\": [1, 2.0, \"<&é>\"]}|{\n  \"role\": \"user\",\n  \"x\": [\n    1,\n    2.0,\n    \"<&é>\"\n  ]\n}|[1,2.0,\"<&é>\"]"
        );
    }

    #[test]
    fn raise_exception_reports_the_template_message() {
        let err = render(
            "{{ raise_exception('No user query found in messages.') }}",
            json!([]),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "chat template: No user query found in messages."
        );
    }

    #[test]
    fn python_idioms_work() {
        let out = render(
            "{% for m in messages[::-1] %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}{% if loop.nextitem %},{% endif %}{% endfor %}\
             {% set ns = namespace(i=0) %}{% for m in messages %}{% if loop.index0 == 0 %}{% continue %}{% endif %}{% set ns.i = ns.i + 1 %}{% endfor %}[{{ ns.i }}]\
             {{ add_generation_prompt is true }}{{ enable_thinking is defined }}",
            json!([{"role": "user", "content": "a</think>\n\nb"}, {"role": "assistant", "content": "c"}]),
        )
        .unwrap();
        // booleans print as Python prints them
        assert_eq!(out, "c,b[1]TrueFalse");
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-02-29 13:05:09 UTC was a Thursday.
        assert_eq!(
            strftime(1_709_211_909, "%Y-%m-%d %H:%M:%S %A %a %B %b %-d %y %%"),
            "2024-02-29 13:05:09 Thursday Thu February Feb 29 24 %"
        );
    }
}
