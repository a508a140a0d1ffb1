//! The checkpoint's tokenizer (tokenizer.json, via the `tokenizers` crate) and a streaming decoder.
//!
//! `encode` adds no BOS and no post-processor tokens (Qwen prompts carry none) but recognises the
//! added special tokens written in the text (`<|im_start|>` → 248045): the chat template renders
//! them as text. Normalisation (NFC for Qwen3.5/3.6) and the pre-tokenizer regex come from
//! tokenizer.json itself.
//!
//! [`IncrementalDecoder`] is `tokenizers`' decode-stream algorithm (`step_decode_stream`, the same
//! code `Tokenizer::decode_stream` runs) with the state owned here instead of borrowed, so a decoder
//! can live in a sequence next to an `Arc<Tokenizer>`. Each step decodes a short window of ids and
//! emits only the text beyond the previous window; while the window's text ends in U+FFFD (a UTF-8
//! character whose bytes are spread over byte-level tokens, not all seen yet) nothing is emitted, so
//! no piece ever splits a character. [`IncrementalDecoder::finish`] flushes what is left.

use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: not found (the checkpoint directory needs a tokenizer.json)")]
    Missing { path: PathBuf },
    #[error("{path}: cannot load tokenizer: {detail}")]
    Invalid { path: PathBuf, detail: String },
    #[error("cannot encode text: {0}")]
    Encode(String),
}

#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({} tokens)", self.vocab_size())
    }
}

/// A string containing every byte value that can occur in UTF-8: all of U+0000..U+00FF (single
/// bytes and the two-byte lead/continuation bytes) and one character per three- and four-byte
/// lead byte. A byte-level tokenizer that encodes it can encode any text.
fn byte_coverage_probe() -> String {
    let mut s: String = (0u32..=0xFF).filter_map(char::from_u32).collect();
    s.extend((0xE0u32..=0xEF).filter_map(|lead| char::from_u32(((lead - 0xE0) << 12) | 0x0800)));
    s.extend(
        [0x10000u32, 0x40000, 0x80000, 0xC0000, 0x100000]
            .iter()
            .filter_map(|&c| char::from_u32(c)),
    );
    s
}

impl Tokenizer {
    /// `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        // A FIFO or device named tokenizer.json would block the read for ever.
        if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
            return Err(TokenizerError::Invalid {
                path: path.to_path_buf(),
                detail: "not a regular file (a FIFO, device or directory)".into(),
            });
        }
        let bytes = std::fs::read(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => TokenizerError::Missing {
                path: path.to_path_buf(),
            },
            _ => TokenizerError::Invalid {
                path: path.to_path_buf(),
                detail: e.to_string(),
            },
        })?;
        Self::from_bytes(&bytes).map_err(|e| match e {
            TokenizerError::Invalid { detail, .. } => TokenizerError::Invalid {
                path: path.to_path_buf(),
                detail,
            },
            other => other,
        })
    }

    /// From the bytes of a tokenizer.json (e.g. decompressed by the caller).
    pub fn from_bytes(bytes: &[u8]) -> Result<Tokenizer, TokenizerError> {
        let invalid = |detail: String| TokenizerError::Invalid {
            path: PathBuf::from("<tokenizer.json>"),
            detail,
        };
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| invalid(e.to_string()))?;
        let tokenizer = Tokenizer {
            inner: Arc::new(inner),
        };
        // `encode` is infallible by contract: make sure up front that any text can be encoded.
        tokenizer.try_encode(&byte_coverage_probe()).map_err(|e| {
            invalid(format!(
                "it cannot encode every byte ({e}); calla needs a byte-level tokenizer"
            ))
        })?;
        Ok(tokenizer)
    }

    /// Token ids of `text`: no BOS, special tokens written in the text recognised.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        // Cannot fail: from_bytes checked that every byte value encodes (byte-level BPE).
        self.try_encode(text)
            .unwrap_or_else(|e| unreachable!("byte-level tokenizer failed to encode: {e}"))
    }

    pub fn try_encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, false)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Text of `ids`; with `skip_special`, special added tokens are left out. Unknown ids are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        // The byte-level decoder has no failure mode; an error here would come from a custom decoder.
        self.inner.decode(ids, skip_special).unwrap_or_default()
    }

    /// Id of a token string (vocabulary or added token), e.g. `token_id("<|im_end|>")`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (byte-level form for vocabulary tokens).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens (not the model's padded embedding rows).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Ids of the added tokens marked special (`<|im_end|>`, `<think>` …), sorted.
    pub fn special_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn incremental_decoder(&self, skip_special: bool) -> IncrementalDecoder {
        IncrementalDecoder::new(self.clone(), skip_special)
    }
}

/// Streaming detokenizer: feed ids one at a time, get text pieces that never split a character.
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    skip_special: bool,
    /// decode-stream state: the id window, the text it decodes to, and where the prefix ends
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl IncrementalDecoder {
    pub fn new(tokenizer: Tokenizer, skip_special: bool) -> Self {
        IncrementalDecoder {
            tokenizer,
            skip_special,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// Add one id; returns the text it completes, if any.
    pub fn step(&mut self, id: u32) -> Option<String> {
        let result = tokenizers::tokenizer::step_decode_stream(
            &self.tokenizer.inner,
            vec![id],
            self.skip_special,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        );
        match result {
            Ok(piece) => piece.filter(|p| !p.is_empty()),
            // A decoder whose output for a longer window does not extend its output for the shorter
            // one (not the case for byte-level BPE): restart the window at this id.
            Err(_) => {
                self.ids = vec![id];
                self.prefix.clear();
                self.prefix_index = 0;
                let text = self.tokenizer.decode(&self.ids, self.skip_special);
                if text.is_empty() || text.ends_with('\u{FFFD}') {
                    None
                } else {
                    self.prefix = text.clone();
                    self.prefix_index = self.ids.len();
                    Some(text)
                }
            }
        }
    }

    /// Text still held back (an unfinished character at the end of the stream), decoded lossily.
    /// The decoder is reset.
    pub fn finish(&mut self) -> Option<String> {
        // `prefix` is the text of the ids already emitted (the first `prefix_index` of the window).
        let full = self.tokenizer.decode(&self.ids, self.skip_special);
        let rest = full
            .strip_prefix(self.prefix.as_str())
            .unwrap_or("")
            .to_string();
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        (!rest.is_empty()).then_some(rest)
    }
}

#[cfg(test)]
#[path = "tokenizer_tests.rs"]
mod tests;
