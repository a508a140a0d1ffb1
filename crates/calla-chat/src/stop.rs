//! Stop strings matched on the generated text across token boundaries.
//!
//! Text is released as soon as no stop string can begin in it: only the longest suffix that is a proper
//! prefix of some stop string is held back. The stop string itself is never released. When several stop
//! strings occur, the one that completes first (earliest end, then earliest start) wins, which is what a
//! streaming reader can decide, so every split of the text into pieces gives the same output.

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text that is safe to emit (possibly empty).
    Continue(String),
    /// A stop string matched: `text` is what precedes it and is the last output; `stop` indexes the list.
    Stopped { text: String, stop: usize },
}

impl StopMatcher {
    /// Empty strings are ignored (they would stop before the first character).
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    pub fn push(&mut self, piece: &str) -> StopOutcome {
        if self.stopped {
            return StopOutcome::Continue(String::new());
        }
        if self.stops.is_empty() {
            return StopOutcome::Continue(piece.to_string());
        }
        // A match can only complete inside the newly pushed text, but may start in what was held back.
        let search_from = self.pending.len();
        self.pending.push_str(piece);
        if let Some((start, stop)) = self.earliest_completed(search_from) {
            let text = self.pending[..start].to_string();
            self.pending.clear();
            self.stopped = true;
            return StopOutcome::Stopped { text, stop };
        }
        let keep = self.longest_partial_suffix();
        let released = self.pending[..self.pending.len() - keep].to_string();
        self.pending.drain(..self.pending.len() - keep);
        StopOutcome::Continue(released)
    }

    /// The held-back text once generation ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// (start, stop index) of the match that ends first among those ending after `min_end_exclusive`.
    fn earliest_completed(&self, min_end_exclusive: usize) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, stop)
        for (i, stop) in self.stops.iter().enumerate() {
            // The first occurrence that ends inside the new text; earlier ones were already ruled out.
            let from = min_end_exclusive.saturating_sub(stop.len() - 1);
            let from = floor_char_boundary(&self.pending, from);
            if let Some(offset) = self.pending[from..].find(stop.as_str()) {
                let start = from + offset;
                let end = start + stop.len();
                if best.is_none_or(|(e, s, _)| (end, start) < (e, s)) {
                    best = Some((end, start, i));
                }
            }
        }
        best.map(|(_, start, stop)| (start, stop))
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn longest_partial_suffix(&self) -> usize {
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let window_start = self
            .pending
            .len()
            .saturating_sub(longest_stop.saturating_sub(1));
        for (start, _) in self.pending[floor_char_boundary(&self.pending, window_start)..]
            .char_indices()
            .map(|(i, c)| (i + floor_char_boundary(&self.pending, window_start), c))
        {
            let suffix = &self.pending[start..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            {
                return suffix.len();
            }
        }
        0
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The whole text at once: what precedes the first completed stop string, and which one.
pub fn truncate_at_stop(text: &str, stops: &[String]) -> (String, Option<usize>) {
    let mut matcher = StopMatcher::new(stops);
    match matcher.push(text) {
        StopOutcome::Stopped { text, stop } => (text, Some(stop)),
        StopOutcome::Continue(mut released) => {
            released.push_str(&matcher.finish());
            (released, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn run_pieces(pieces: &[&str], stop_list: &[String]) -> (String, Option<usize>) {
        let mut m = StopMatcher::new(stop_list);
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped { text, stop } => {
                    out.push_str(&text);
                    return (out, Some(stop));
                }
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    #[test]
    fn stop_split_across_tokens_is_never_emitted() {
        let s = stops(&["END"]);
        let mut m = StopMatcher::new(&s);
        assert_eq!(m.push("hello E"), StopOutcome::Continue("hello ".into()));
        assert_eq!(m.push("N"), StopOutcome::Continue(String::new()));
        assert_eq!(
            m.push("D and more"),
            StopOutcome::Stopped {
                text: String::new(),
                stop: 0
            }
        );
    }

    #[test]
    fn holds_back_only_a_possible_prefix() {
        let s = stops(&["abc", "xy"]);
        let mut m = StopMatcher::new(&s);
        assert_eq!(m.push("zza"), StopOutcome::Continue("zz".into()));
        // "ab" could still become "abc"
        assert_eq!(m.push("b"), StopOutcome::Continue(String::new()));
        // "abd" cannot: release all of it
        assert_eq!(m.push("d"), StopOutcome::Continue("abd".into()));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn the_first_stop_to_complete_wins() {
        let s = stops(&["abcd", "bc"]);
        assert_eq!(truncate_at_stop("xabcd", &s), ("xa".into(), Some(1)));
        assert_eq!(run_pieces(&["xab", "cd"], &s), ("xa".into(), Some(1)));
    }

    #[test]
    fn multibyte_stops_and_text() {
        let s = stops(&["é!"]);
        assert_eq!(
            run_pieces(&["caf", "é", "!", "x"], &s),
            ("caf".into(), Some(0))
        );
        assert_eq!(run_pieces(&["caf", "é", "é"], &s), ("caféé".into(), None));
    }

    proptest! {
        #[test]
        fn any_split_gives_the_whole_text_result(
            text in "[ab€ ]{0,24}",
            stop_list in proptest::collection::vec("[ab€]{1,3}", 0..3),
            cuts in proptest::collection::vec(0usize..30, 0..8),
        ) {
            let whole = truncate_at_stop(&text, &stop_list);
            let mut bounds: Vec<usize> = cuts.into_iter()
                .map(|c| c.min(text.len()))
                .filter(|c| text.is_char_boundary(*c))
                .collect();
            bounds.push(0);
            bounds.push(text.len());
            bounds.sort();
            bounds.dedup();
            let pieces: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            prop_assert_eq!(run_pieces(&pieces, &stop_list), whole.clone());
            // and the result is right: a prefix of the text with no stop string inside
            prop_assert!(text.starts_with(&whole.0));
            for s in &stop_list {
                prop_assert!(!whole.0.contains(s.as_str()));
            }
        }
    }
}
