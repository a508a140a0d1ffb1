//! Text ↔ token ids as the server needs them, and UTF-8-safe incremental detokenization.
//!
//! The server works through [`TextCodec`] so it runs with the checkpoint's tokenizer and, in tests,
//! with small doubles. [`IncrementalText`] turns ids into text pieces that never split a character:
//! it decodes a short window of recent ids and releases only the new text once it no longer ends in
//! an incomplete byte sequence (U+FFFD), the method of `tokenizers`' DecodeStream.

pub trait TextCodec: Send + Sync {
    /// Encode text (special tokens written in the text are recognised; no BOS is added).
    fn encode(&self, text: &str) -> Result<Vec<u32>, String>;
    /// Decode ids, skipping special tokens (as output text is shown).
    fn decode(&self, ids: &[u32]) -> String;
    /// One token as text, special tokens included (for log-probabilities).
    fn token_text(&self, id: u32) -> String;
    /// Ids are below this.
    fn vocab_size(&self) -> usize;
    /// Every token's bytes, for constrained decoding (structured.rs: special tokens as 0xFF + their
    /// name). None: this codec cannot be constrained.
    fn vocab_bytes(&self) -> Option<Vec<Vec<u8>>> {
        None
    }
}

pub struct IncrementalText {
    ids: Vec<u32>,
    /// ids[..prefix] are context only; ids[prefix..read] were released.
    prefix: usize,
    read: usize,
}

impl Default for IncrementalText {
    fn default() -> Self {
        Self::new()
    }
}

impl IncrementalText {
    pub fn new() -> IncrementalText {
        IncrementalText {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// The text that `id` completes (often all of it, sometimes nothing yet).
    pub fn push(&mut self, codec: &dyn TextCodec, id: u32) -> String {
        self.ids.push(id);
        let released = codec.decode(&self.ids[self.prefix..self.read]);
        let full = codec.decode(&self.ids[self.prefix..]);
        if full.len() > released.len() && !full.ends_with('\u{FFFD}') {
            let piece = match full.strip_prefix(released.as_str()) {
                Some(piece) => piece.to_string(),
                None => full[released.len().min(full.len())..].to_string(),
            };
            // Keep a window of context for the next decode; drop what is no longer needed.
            self.prefix = self.read;
            self.read = self.ids.len();
            if self.prefix > 0 {
                self.ids.drain(..self.prefix);
                self.read -= self.prefix;
                self.prefix = 0;
            }
            return piece;
        }
        String::new()
    }

    /// What is still held (an incomplete character at the very end), replacement characters and all.
    pub fn finish(&mut self, codec: &dyn TextCodec) -> String {
        let released = codec.decode(&self.ids[self.prefix..self.read]);
        let full = codec.decode(&self.ids[self.prefix..]);
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        full.strip_prefix(released.as_str())
            .map(str::to_string)
            .unwrap_or_default()
    }
}

/// The checkpoint's tokenizer.
impl TextCodec for calla_model::tokenizer::Tokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.try_encode(text).map_err(|e| e.to_string())
    }
    fn decode(&self, ids: &[u32]) -> String {
        calla_model::tokenizer::Tokenizer::decode(self, ids, true)
    }
    fn token_text(&self, id: u32) -> String {
        calla_model::tokenizer::Tokenizer::decode(self, &[id], false)
    }
    fn vocab_size(&self) -> usize {
        calla_model::tokenizer::Tokenizer::vocab_size(self)
    }
    fn vocab_bytes(&self) -> Option<Vec<Vec<u8>>> {
        Some(crate::structured::tokenizer_vocab_bytes(self))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// ids 0..256 are bytes; 256 is a special token that decodes to nothing when skipped.
    pub struct ByteCodec;
    impl TextCodec for ByteCodec {
        fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn decode(&self, ids: &[u32]) -> String {
            let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        fn token_text(&self, id: u32) -> String {
            if id < 256 {
                self.decode(&[id])
            } else {
                "<special>".into()
            }
        }
        fn vocab_size(&self) -> usize {
            257
        }
    }

    #[test]
    fn pieces_never_split_a_character() {
        let text = "a€😀b";
        let mut inc = IncrementalText::new();
        let mut pieces = Vec::new();
        for id in ByteCodec.encode(text).unwrap() {
            pieces.push(inc.push(&ByteCodec, id));
        }
        pieces.push(inc.finish(&ByteCodec));
        assert_eq!(pieces.concat(), text);
        assert!(pieces.contains(&"€".to_string()) && pieces.contains(&"😀".to_string()));
        // an incomplete character at the end comes out as a replacement character
        let mut inc = IncrementalText::new();
        assert_eq!(inc.push(&ByteCodec, 0xE2), "");
        assert_eq!(inc.finish(&ByteCodec), "\u{FFFD}");
    }
}
