//! Constrained decoding over the real Qwen3.6 tokenizer (248K tokens, byte-level BPE): every
//! token's bytes as the grammar engine sees them match what the tokenizer encodes, and a JSON schema
//! lets exactly the tokens of a valid reply through, then EOS.

mod common;

use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use calla_model::tokenizer::Tokenizer;
use calla_server::structured::{parser_factory, OutputGrammar};
use calla_server::TextCodec;
use common::repo_root;
use serde_json::json;

fn qwen_tokenizer() -> Option<Tokenizer> {
    let path = repo_root().join("tests/fixtures/tokenizer/qwen3.6-tokenizer.json.gz");
    let file = std::fs::File::open(path).ok()?;
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut bytes)
        .ok()?;
    Some(Tokenizer::from_bytes(&bytes).expect("the fixture tokenizer parses"))
}

#[test]
fn vocab_bytes_spell_what_the_tokenizer_encodes() {
    let Some(tok) = qwen_tokenizer() else {
        eprintln!("SKIPPED: the Qwen tokenizer fixture is absent");
        return;
    };
    let words = tok.vocab_bytes().unwrap();
    assert_eq!(words.len(), TextCodec::vocab_size(&tok));
    for text in [
        "Hello, world!",
        "  indented\n\ttabs",
        "naïve café — 東京 😀",
        "{\"a\": [1, 2.5e-3]}",
        "<tool_call>\n<function=f>",
    ] {
        let ids = TextCodec::encode(&tok, text).unwrap();
        let spelled: Vec<u8> = ids
            .iter()
            .flat_map(|&id| words[id as usize].clone())
            .collect();
        assert_eq!(String::from_utf8_lossy(&spelled), text, "{ids:?}");
    }
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(
        words[im_end as usize][0], 0xFF,
        "special tokens carry the trie's marker"
    );
}

#[test]
fn a_schema_lets_a_valid_reply_through_then_only_eos() {
    let Some(tok) = qwen_tokenizer() else {
        eprintln!("SKIPPED: the Qwen tokenizer fixture is absent");
        return;
    };
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let model_vocab = TextCodec::vocab_size(&tok) + 100; // padding rows, as real checkpoints have
    let codec: Arc<dyn TextCodec> = Arc::new(tok.clone());
    let started = Instant::now();
    let factory = parser_factory(Arc::clone(&codec), model_vocab, &[im_end]).unwrap();
    eprintln!("factory: {:.2} s", started.elapsed().as_secs_f64());
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": false});
    let mut c = OutputGrammar::JsonSchema(schema)
        .constraint(&factory, false)
        .unwrap();
    let reply = r#"{"city": "Paris", "days": 3}"#;
    let started = Instant::now();
    for id in codec.encode(reply).unwrap() {
        let mask = c.allowed(model_vocab).unwrap();
        assert!(
            mask.allows(id),
            "token {id} ({:?}) refused",
            tok.decode(&[id], false)
        );
        assert!(
            !mask.allows(model_vocab as u32 - 1),
            "padding rows are never allowed"
        );
        c.accept(id).unwrap();
    }
    // complete: generation ends there (or at EOS, the only token still allowed)
    assert!(c.is_finished());
    let mask = c.allowed(model_vocab).unwrap();
    assert!(mask.allows(im_end));
    assert_eq!(mask.count(), 1, "only EOS once the object is complete");
    eprintln!(
        "masks: {:.2} ms per token",
        started.elapsed().as_secs_f64() * 1e3 / 12.0
    );
    // an invalid continuation is refused
    let mut c = OutputGrammar::JsonSchema(json!({"type": "integer"}))
        .constraint(&factory, false)
        .unwrap();
    let mask = c.allowed(model_vocab).unwrap();
    let letter = codec.encode("x").unwrap()[0];
    assert!(!mask.allows(letter));
}
