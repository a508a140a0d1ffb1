//! Tokenizer tests on the real Qwen3.5/3.6 vocabulary (tests/fixtures/tokenizer) and the fixtures'
//! tiny tokenizers.

use super::*;
use std::io::Read;

fn repo_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// The real vocabulary (loaded once), or None (with a message) while the fixture is absent.
fn qwen_tokenizer() -> Option<Tokenizer> {
    static TOKENIZER: std::sync::OnceLock<Option<Tokenizer>> = std::sync::OnceLock::new();
    let loaded = TOKENIZER.get_or_init(|| {
        let path = repo_path("tests/fixtures/tokenizer/qwen3.6-tokenizer.json.gz");
        let file = std::fs::File::open(&path).ok()?;
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(file)
            .read_to_end(&mut json)
            .unwrap();
        Some(Tokenizer::from_bytes(&json).unwrap())
    });
    if loaded.is_none() {
        eprintln!("SKIPPED: tests/fixtures/tokenizer/qwen3.6-tokenizer.json.gz is absent");
    }
    loaded.clone()
}

struct Sample {
    name: String,
    text: String,
    ids: Vec<u32>,
}

fn samples() -> Vec<Sample> {
    let text =
        std::fs::read_to_string(repo_path("tests/fixtures/tokenizer/reference_ids.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Sample {
            name: s["name"].as_str().unwrap().to_string(),
            text: s["text"].as_str().unwrap().to_string(),
            ids: s["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect(),
        })
        .collect()
}

#[test]
fn encodes_the_reference_ids() {
    let Some(tok) = qwen_tokenizer() else { return };
    let samples = samples();
    assert!(samples.len() > 30);
    for s in &samples {
        assert_eq!(tok.encode(&s.text), s.ids, "sample {}", s.name);
    }
}

#[test]
fn decodes_back_to_the_text() {
    let Some(tok) = qwen_tokenizer() else { return };
    for s in samples() {
        let decoded = tok.decode(&s.ids, false);
        if ["nfd_input_composes", "combining_marks_without_precomposed"].contains(&s.name.as_str())
        {
            // NFC normalisation: the decoded text is the composed (and reordered) form, which
            // encodes to the same ids.
            assert_ne!(decoded, s.text, "sample {}", s.name);
            assert_eq!(tok.encode(&decoded), s.ids, "sample {}", s.name);
        } else {
            assert_eq!(decoded, s.text, "sample {}", s.name);
        }
    }
}

#[test]
fn special_tokens_and_ids() {
    let Some(tok) = qwen_tokenizer() else { return };
    assert_eq!(tok.token_id("<|endoftext|>"), Some(248044));
    assert_eq!(tok.token_id("<|im_end|>"), Some(248046));
    assert_eq!(tok.token_id("<think>"), Some(248068));
    assert_eq!(tok.token_id("no such token"), None);
    assert_eq!(tok.vocab_size(), 248077);
    let special = tok.special_ids();
    assert!(special.contains(&248044) && special.contains(&248046));
    // No BOS is added.
    assert_eq!(
        tok.encode("The capital of France is"),
        vec![760, 6511, 314, 9338, 369]
    );
    let chat = tok.encode("<|im_start|>user\nhi<|im_end|>");
    assert_eq!(chat.first(), Some(&248045));
    assert_eq!(tok.decode(&chat, true), "user\nhi");
}

/// Streaming every sample id by id reproduces the full decode, and no piece contains U+FFFD
/// unless the text does; multi-token characters are held back until complete.
#[test]
fn incremental_decoding_never_splits_a_character() {
    let Some(tok) = qwen_tokenizer() else { return };
    let mut held_back = 0;
    for s in samples() {
        for skip in [false, true] {
            let mut dec = tok.incremental_decoder(skip);
            let mut pieces = Vec::new();
            for &id in &s.ids {
                match dec.step(id) {
                    Some(p) => pieces.push(p),
                    None => held_back += 1,
                }
            }
            if let Some(rest) = dec.finish() {
                pieces.push(rest);
            }
            let full = tok.decode(&s.ids, skip);
            assert_eq!(
                pieces.concat(),
                full,
                "sample {} (skip_special {skip})",
                s.name
            );
            if !full.contains('\u{FFFD}') {
                assert!(
                    pieces.iter().all(|p| !p.contains('\u{FFFD}')),
                    "sample {}: {pieces:?}",
                    s.name
                );
            }
        }
    }
    assert!(
        held_back > 0,
        "some sample has characters spread over several tokens"
    );
}

/// A stream cut inside a character: nothing of the partial character is emitted by `step`;
/// `finish` flushes it lossily.
#[test]
fn finish_flushes_an_incomplete_character() {
    let Some(tok) = qwen_tokenizer() else { return };
    let ids = tok.encode("ok 🫠 힣 🧪");
    let cut = (1..ids.len())
        .find(|&n| tok.decode(&ids[..n], false).ends_with('\u{FFFD}'))
        .expect("a prefix that ends inside a character");
    let mut dec = tok.incremental_decoder(false);
    let emitted: String = ids[..cut].iter().filter_map(|&id| dec.step(id)).collect();
    assert!(!emitted.contains('\u{FFFD}'));
    let rest = dec.finish().expect("held-back bytes");
    assert!(rest.ends_with('\u{FFFD}'));
    assert_eq!(emitted + &rest, tok.decode(&ids[..cut], false));
    assert_eq!(dec.finish(), None, "finish resets");
}

#[test]
fn tiny_fixture_tokenizers_load() {
    let dir = repo_path("tests/fixtures/models/qwen35moe-causal-perexpert");
    if !dir.is_dir() {
        eprintln!("SKIPPED: {} is absent", dir.display());
        return;
    }
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let ids = tok.encode("hello <|im_end|>");
    assert_eq!(tok.decode(&ids, false), "hello <|im_end|>");
    assert!(ids.contains(&tok.token_id("<|im_end|>").unwrap()));
    assert!(ids.iter().all(|&id| (id as usize) < 512));
}

#[test]
fn missing_and_invalid_tokenizer_files() {
    let dir = std::env::temp_dir().join(format!("calla-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::Missing { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::write(dir.join("tokenizer.json"), "{\"not\": \"a tokenizer\"}").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::Invalid { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
