//! The one primitive the streaming parsers share: find a tag in buffered text, or say how much of the
//! buffer can be released because no tag can start in it.

/// The earliest complete occurrence of any of `tags` in `text`: (byte offset, index into `tags`).
pub(crate) fn find_first(text: &str, tags: &[&str]) -> Option<(usize, usize)> {
    tags.iter()
        .enumerate()
        .filter_map(|(i, tag)| text.find(tag).map(|at| (at, i)))
        .min()
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags` (it may still grow
/// into a tag, so it must be held back). Tags are ASCII, so the suffix starts on a char boundary.
pub(crate) fn partial_tag_suffix(text: &str, tags: &[&str]) -> usize {
    let longest = tags.iter().map(|t| t.len()).max().unwrap_or(0);
    let bytes = text.as_bytes();
    for len in (1..longest.min(bytes.len() + 1)).rev() {
        let suffix = &bytes[bytes.len() - len..];
        if tags
            .iter()
            .any(|t| t.len() > len && t.as_bytes().starts_with(suffix))
        {
            return len;
        }
    }
    0
}

/// Whether `text` could still turn out to start with `tag` (it is a prefix of it, or starts with it).
pub(crate) fn may_start_with(text: &str, tag: &str) -> bool {
    text.starts_with(tag) || tag.starts_with(text)
}

/// Split off the trailing whitespace of `text`: (body, whitespace).
pub(crate) fn split_trailing_whitespace(text: &str) -> (&str, &str) {
    let body = text.trim_end();
    (body, &text[body.len()..])
}
