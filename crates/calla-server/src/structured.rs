//! Structured output by constrained decoding (llguidance over the checkpoint's tokenizer).
//!
//! What is enforced: `response_format` json_object / json_schema (chat), Responses `text.format`,
//! and forced tool calls (`tool_choice` required or a named function; `parallel_tool_calls: false`
//! allows one call). A request's constraint becomes a grammar ([`OutputGrammar`]), compiled once per
//! request into an llguidance `Matcher` per choice, and driven by the engine's generation loop
//! through `calla_engine::TokenConstraint` (the engine's constraint.rs says where the mask applies).
//!
//! Forced tool calls follow the Qwen3.5/3.6 XML call format the output parser reads
//! (`<tool_call>\n<function=NAME>\n<parameter=K>\nVALUE\n</parameter>\n</function>\n</tool_call>`):
//! the name is one of the declared tools; each parameter is one of the tool's `properties`, the
//! `required` ones always present, in declaration order; a value typed other than string is JSON
//! valid against the property's schema; a string value is free text (not containing the call's
//! tags), limited by the property's `enum` / `maxLength` / `minLength` when given.
//!
//! JSON is generated compactly with `", "` / `": "` separators and no other whitespace (so a
//! model cannot pad forever). Thinking: when the request turns thinking on explicitly
//! (`chat_template_kwargs.enable_thinking: true`, Anthropic `thinking`, a Responses
//! `reasoning.effort`), the reply may reason first, unconstrained up to `</think>`, and the
//! constraint applies after it; otherwise the think block the prompt opens is closed first and the
//! reply carries no reasoning (a reasoning that never ends runs into max_tokens).
//!
//! The token trie and the parser factory are built once, at the first constrained request (about a
//! second for a 248K vocabulary), and shared.

use std::sync::{Arc, OnceLock};

use calla_engine::{TokenConstraint, TokenMask};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};

use crate::codec::TextCodec;
use crate::errors::ApiError;
use crate::state::Runtime;

/// Whether template kwargs turn thinking on explicitly (`enable_thinking: true`).
pub fn thinking_requested(kwargs: Option<&serde_json::Map<String, Json>>) -> bool {
    kwargs.and_then(|k| k.get("enable_thinking")) == Some(&Json::Bool(true))
}

/// What a reply must be.
#[derive(Debug, Clone)]
pub enum OutputGrammar {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(Json),
    /// Tool calls only: to one of `tools` (OpenAI function tools), at most one unless `parallel`.
    ToolCalls { tools: Vec<Json>, parallel: bool },
}

/// OpenAI `response_format` (chat) → the grammar: None for `text` or absent; 400 for anything else.
pub fn response_format(
    value: Option<&Json>,
    param: &str,
) -> Result<Option<OutputGrammar>, ApiError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = value.get("type").and_then(Json::as_str).ok_or_else(|| {
        ApiError::bad_param(
            format!("{param}.type"),
            format!("'{param}' must be an object with a 'type': text, json_object or json_schema"),
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(match value.get("schema") {
            // llama.cpp's extension: json_object with a schema.
            Some(schema) if schema.is_object() => OutputGrammar::JsonSchema(schema.clone()),
            _ => OutputGrammar::JsonObject,
        })),
        "json_schema" => {
            // chat: {type, json_schema: {name, schema, strict}}; Responses: {type, name, schema, strict}
            let holder = value.get("json_schema").unwrap_or(value);
            match holder.get("schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    Ok(Some(OutputGrammar::JsonSchema(schema.clone())))
                }
                _ => Err(ApiError::bad_param(
                    format!("{param}.json_schema.schema"),
                    format!("'{param}' of type json_schema needs a JSON schema object in 'schema'"),
                )),
            }
        }
        other => Err(ApiError::bad_param(
            format!("{param}.type"),
            format!("'{param}.type' must be text, json_object or json_schema (got '{other}')"),
        )),
    }
}

/// The reasoning before a constrained reply: everything up to the first `</think>`.
const THINK: &str = r"think[lazy]: /(?s:.)*<\/think>/";

const JSON_OPTIONS: &str =
    r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

/// A schema with calla's JSON layout options.
fn with_layout(schema: &Json) -> Json {
    let mut schema = match schema {
        Json::Bool(true) => json!({}),
        Json::Bool(false) => json!({"not": {}}),
        other => other.clone(),
    };
    if let Some(obj) = schema.as_object_mut() {
        obj.insert(
            "x-guidance".into(),
            serde_json::from_str(JSON_OPTIONS).expect("valid options"),
        );
    }
    schema
}

fn lark_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

/// Free text of a string parameter: never containing the call's tags.
fn string_value_terminal(schema: &Json) -> String {
    let min = schema.get("minLength").and_then(Json::as_u64).unwrap_or(0);
    let len = match schema.get("maxLength").and_then(Json::as_u64) {
        Some(max) => format!("{{{min},{}}}", max.max(min)),
        None => format!("{{{min},}}"),
    };
    format!(r"/(?s:.){len}/ & ~/(?s:.*)<\/?(parameter|function|tool_call)(?s:.*)/")
}

fn is_string_schema(schema: &Json) -> bool {
    match schema.get("type") {
        Some(Json::String(t)) => t == "string",
        Some(Json::Array(types)) => {
            types.iter().filter_map(Json::as_str).find(|t| *t != "null") == Some("string")
        }
        None => schema
            .get("enum")
            .and_then(Json::as_array)
            .is_some_and(|e| !e.is_empty() && e.iter().all(Json::is_string)),
        _ => false,
    }
}

/// The lark grammar of forced tool calls (see the header).
fn tool_calls_lark(tools: &[Json], parallel: bool) -> String {
    let mut rules = Vec::new();
    let mut terminals = Vec::new();
    let mut calls = Vec::new();
    for (t, tool) in tools.iter().enumerate() {
        let function = tool.get("function").unwrap_or(tool);
        let name = function
            .get("name")
            .and_then(Json::as_str)
            .unwrap_or_default();
        let parameters = function.get("parameters").cloned().unwrap_or(json!({}));
        let required: Vec<&str> = parameters
            .get("required")
            .and_then(Json::as_array)
            .map(|r| r.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        let mut body = Vec::new();
        if let Some(props) = parameters.get("properties").and_then(Json::as_object) {
            for (p, (key, schema)) in props.iter().enumerate() {
                const CLOSE: &str = "\"\\n</parameter>\\n\"";
                let enum_options = schema
                    .get("enum")
                    .and_then(Json::as_array)
                    .filter(|o| !o.is_empty());
                // A value and its closing tag: free text is one terminal with the tag (a lexeme
                // cannot end where the text might go on, so the tag must end it); the others
                // are lexemes that end by themselves.
                let value = match enum_options {
                    Some(options) if is_string_schema(schema) => format!(
                        "({}) {CLOSE}",
                        options
                            .iter()
                            .filter_map(Json::as_str)
                            .map(lark_string)
                            .collect::<Vec<_>>()
                            .join(" | ")
                    ),
                    _ if is_string_schema(schema) => {
                        let text = format!("TEXT_{t}_{p}");
                        let terminal = format!("VALUE_{t}_{p}");
                        terminals.push(format!("{text}: {}", string_value_terminal(schema)));
                        terminals.push(format!("{terminal}: {text} {CLOSE}"));
                        terminal
                    }
                    _ => {
                        // `$ref`s point into the parameters' own definitions: carry them along.
                        let mut schema = with_layout(schema);
                        for defs in ["$defs", "definitions"] {
                            if let (Some(d), Some(obj)) =
                                (parameters.get(defs), schema.as_object_mut())
                            {
                                obj.entry(defs).or_insert_with(|| d.clone());
                            }
                        }
                        format!("%json {schema} {CLOSE}")
                    }
                };
                let open = lark_string(&format!("<parameter={key}>\n"));
                let item = format!("{open} {value}");
                body.push(if required.contains(&key.as_str()) {
                    format!("({item})")
                } else {
                    format!("({item})?")
                });
            }
        }
        let open = lark_string(&format!("<tool_call>\n<function={name}>\n"));
        rules.push(format!(
            "call_{t}: {open} {} \"</function>\\n</tool_call>\"",
            body.join(" ")
        ));
        calls.push(format!("call_{t}"));
    }
    let start = if parallel {
        "start: call (\"\\n\" call)*"
    } else {
        "start: call"
    };
    format!(
        "{start}\ncall: {}\n{}\n{}\n",
        calls.join(" | "),
        rules.join("\n"),
        terminals.join("\n")
    )
}

impl OutputGrammar {
    /// The grammar; `think_first`: the reply starts inside a think block (the prompt opened it),
    /// free text up to the first `</think>`, then `\n\n`, then the constrained part.
    pub fn to_grammar(&self, think_first: bool) -> TopLevelGrammar {
        let json = |schema: &Json| {
            if think_first {
                TopLevelGrammar::from_lark(format!(
                    "start: think \"\\n\\n\" %json {}\n{THINK}\n",
                    with_layout(schema)
                ))
            } else {
                TopLevelGrammar::from_json_schema(with_layout(schema))
            }
        };
        match self {
            OutputGrammar::JsonObject => json(&json!({"type": "object"})),
            OutputGrammar::JsonSchema(schema) => json(schema),
            OutputGrammar::ToolCalls { tools, parallel } => {
                let calls = tool_calls_lark(tools, *parallel);
                TopLevelGrammar::from_lark(if think_first {
                    format!(
                        "start: think \"\\n\\n\" calls\n{THINK}\n{}",
                        calls.replacen("start:", "calls:", 1)
                    )
                } else {
                    calls
                })
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The tokenizer as llguidance sees it.

/// A byte-level BPE token's characters → its bytes (GPT-2's byte ↔ unicode table).
fn byte_level_char_map() -> std::collections::HashMap<char, u8> {
    let self_mapped =
        |c: char| matches!(c, '!'..='~' | '\u{00A1}'..='\u{00AC}' | '\u{00AE}'..='\u{00FF}');
    let mut map = std::collections::HashMap::new();
    let mut next = 0x100u32;
    for byte in 0..=255u8 {
        if self_mapped(byte as char) {
            map.insert(byte as char, byte);
        } else {
            map.insert(char::from_u32(next).expect("a valid char"), byte);
            next += 1;
        }
    }
    map
}

/// Every token's bytes for the token trie: special added tokens as 0xFF + their name (the trie's
/// marker: grammars never produce them as text), other added tokens as their text, the rest through
/// the byte-level table (or, for a token outside it, its decoded text).
pub fn tokenizer_vocab_bytes(tokenizer: &calla_model::tokenizer::Tokenizer) -> Vec<Vec<u8>> {
    let hf = tokenizer.inner();
    let n = hf.get_vocab_size(true);
    let mut bytes = vec![Vec::new(); n];
    let added = hf.get_added_tokens_decoder();
    let map = byte_level_char_map();
    for (id, slot) in bytes.iter_mut().enumerate() {
        let id = id as u32;
        *slot = if let Some(token) = added.get(&id) {
            if token.special {
                special_bytes(&token.content)
            } else {
                token.content.as_bytes().to_vec()
            }
        } else if let Some(name) = hf.id_to_token(id) {
            name.chars()
                .map(|c| map.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(|| tokenizer.decode(&[id], false).into_bytes())
        } else {
            special_bytes(&format!("<[{id}]>"))
        };
    }
    bytes
}

/// A special token as the trie spells it: the marker byte 0xFF, then its name.
pub fn special_bytes(name: &str) -> Vec<u8> {
    let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    bytes.extend(name.as_bytes());
    bytes
}

struct CodecEnv {
    trie: TokTrie,
    codec: Arc<dyn TextCodec>,
}

impl TokenizerEnv for CodecEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.codec.encode(text).unwrap_or_default())
    }
}

/// The parser factory over `codec`'s vocabulary, padded to the model's `model_vocab` (rows past
/// the tokenizer are special tokens no grammar allows), with the model's `eos` ids as EOS.
pub fn parser_factory(
    codec: Arc<dyn TextCodec>,
    model_vocab: usize,
    eos: &[u32],
) -> Result<ParserFactory, String> {
    let mut words = codec
        .vocab_bytes()
        .ok_or("this tokenizer does not support constrained decoding")?;
    let vocab = model_vocab.max(words.len());
    while words.len() < vocab {
        words.push(special_bytes(&format!("<[{}]>", words.len())));
    }
    let first = *eos.first().ok_or("the model has no EOS token")?;
    let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, first), &words);
    let trie = if eos.len() > 1 {
        trie.with_eos_tokens(eos)
    } else {
        trie
    };
    let env: TokEnv = Arc::new(CodecEnv { trie, codec });
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

/// The parser factory, built at the first constrained request.
#[derive(Default)]
pub struct Grammars {
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    fn factory(&self, runtime: &Runtime) -> Result<Arc<ParserFactory>, ApiError> {
        self.factory
            .get_or_init(|| {
                let started = std::time::Instant::now();
                let factory = parser_factory(
                    Arc::clone(&runtime.codec),
                    runtime.scheduler.vocab_size(),
                    runtime.scheduler.eos_token_ids(),
                )?;
                tracing::info!(
                    "constrained decoding ready ({} tokens, {:.2} s)",
                    factory.tok_env().tok_trie().vocab_size(),
                    started.elapsed().as_secs_f64()
                );
                Ok(Arc::new(factory))
            })
            .clone()
            .map_err(|e| ApiError::bad_request(format!("Structured output is unavailable: {e}")))
    }

    /// `n` constraints for `grammar` (one per choice); a grammar that does not compile is a 400
    /// naming `param`.
    pub fn constraints(
        &self,
        runtime: &Runtime,
        grammar: &OutputGrammar,
        think_first: bool,
        n: usize,
        param: &str,
    ) -> Result<Vec<Box<dyn TokenConstraint>>, ApiError> {
        let factory = self.factory(runtime)?;
        let matcher = grammar.matcher(&factory, think_first).map_err(|e| {
            ApiError::bad_param(param, format!("Invalid schema for '{param}': {e}"))
        })?;
        Ok((0..n)
            .map(|_| Box::new(GrammarConstraint(matcher.deep_clone())) as Box<dyn TokenConstraint>)
            .collect())
    }
}

impl OutputGrammar {
    fn matcher(&self, factory: &ParserFactory, think_first: bool) -> Result<Matcher, String> {
        let parser = factory
            .create_parser(self.to_grammar(think_first))
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(e),
            None => Ok(matcher),
        }
    }

    /// One constraint for this grammar (requests compile once and clone it per choice).
    pub fn constraint(
        &self,
        factory: &ParserFactory,
        think_first: bool,
    ) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(GrammarConstraint(
            self.matcher(factory, think_first)?,
        )))
    }
}

struct GrammarConstraint(Matcher);

impl TokenConstraint for GrammarConstraint {
    fn allowed(&mut self, vocab_size: usize) -> anyhow::Result<TokenMask> {
        let mask = self.0.compute_mask_or_eos()?;
        Ok(TokenMask::from_words(mask.as_slice().to_vec(), vocab_size))
    }
    fn accept(&mut self, token: u32) -> anyhow::Result<()> {
        self.0.consume_token(token)
    }
    fn is_finished(&self) -> bool {
        self.0.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_formats() {
        assert!(response_format(None, "response_format").unwrap().is_none());
        assert!(response_format(Some(&json!({"type": "text"})), "r")
            .unwrap()
            .is_none());
        assert!(matches!(
            response_format(Some(&json!({"type": "json_object"})), "r").unwrap(),
            Some(OutputGrammar::JsonObject)
        ));
        let s = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}});
        assert!(matches!(
            response_format(Some(&s), "r").unwrap(),
            Some(OutputGrammar::JsonSchema(_))
        ));
        for bad in [
            json!({"type": "bogus"}),
            json!("json"),
            json!({"type": "json_schema"}),
        ] {
            let e = response_format(Some(&bad), "response_format").unwrap_err();
            assert_eq!(e.status, 400, "{bad}");
            assert!(e.param.unwrap().starts_with("response_format"));
        }
    }

    #[test]
    fn tool_grammar_names_every_tool_and_marks_required_parameters() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}}),
        ];
        let lark = tool_calls_lark(&tools, false);
        assert!(lark.contains("<function=get_weather>"), "{lark}");
        assert!(
            lark.contains(r#"("\"c\"" | "\"f\"")"#) || lark.contains(r#""c" | "f""#),
            "{lark}"
        );
        assert!(lark.contains("%json"), "{lark}");
        assert!(lark.starts_with("start: call\n"));
    }
}
