//! Saved sequence states keyed by the tokens they have consumed, so a prompt that extends an earlier
//! one (the next turn of a chat, the same prompt again, the n-th choice of a request) restores the
//! state and runs only its new tokens.
//!
//! Bounded by memory: entries are `Sequence` snapshots whose `byte_size` is summed against a budget,
//! and the least recently used go first. A lookup hands out an independent copy, so one entry serves
//! any number of later requests. The number of entries is small (a budget of a few states), so a
//! linear scan is the right structure.

use crate::backend::Sequence;

struct Entry {
    tokens: Vec<u32>,
    state: Box<dyn Sequence>,
    bytes: usize,
    last_used: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub budget_bytes: usize,
    /// Lookups, and those that restored a state.
    pub queries: u64,
    pub hits: u64,
    /// Prompt tokens served from the cache, summed over hits.
    pub hit_tokens: u64,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    budget_bytes: usize,
    used_bytes: usize,
    clock: u64,
    stats: PrefixCacheStats,
}

impl PrefixCache {
    /// A budget of 0 disables the cache.
    pub fn new(budget_bytes: usize) -> PrefixCache {
        PrefixCache {
            entries: Vec::new(),
            budget_bytes,
            used_bytes: 0,
            clock: 0,
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            entries: self.entries.len(),
            bytes: self.used_bytes,
            budget_bytes: self.budget_bytes,
            ..self.stats
        }
    }

    /// A copy of the state of the longest saved prefix of `prompt` that leaves at least one token to
    /// run (a step needs input to choose the next token), with its length.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(usize, Box<dyn Sequence>)> {
        self.stats.queries += 1;
        self.clock += 1;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len())?;
        best.last_used = self.clock;
        self.stats.hits += 1;
        self.stats.hit_tokens += best.tokens.len() as u64;
        Some((best.tokens.len(), best.state.snapshot()))
    }

    /// Save `state`, which has consumed exactly `tokens`. Least recently used entries make room; a
    /// state larger than the whole budget is not kept.
    pub fn insert(&mut self, tokens: Vec<u32>, state: Box<dyn Sequence>) {
        debug_assert_eq!(
            state.len(),
            tokens.len(),
            "a state is keyed by what it consumed"
        );
        self.clock += 1;
        if let Some(existing) = self.entries.iter_mut().find(|e| e.tokens == tokens) {
            existing.last_used = self.clock;
            return;
        }
        let bytes = state.byte_size();
        if bytes > self.budget_bytes || tokens.is_empty() {
            return;
        }
        while self.used_bytes + bytes > self.budget_bytes {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("used bytes > 0 means there is an entry");
            let evicted = self.entries.swap_remove(oldest);
            self.used_bytes -= evicted.bytes;
        }
        self.used_bytes += bytes;
        self.entries.push(Entry {
            tokens,
            state,
            bytes,
            last_used: self.clock,
        });
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.used_bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::Any;

    /// A state that is its token list, `bytes_per_token` bytes each.
    struct Tokens {
        consumed: Vec<u32>,
        bytes_per_token: usize,
    }
    impl Sequence for Tokens {
        fn len(&self) -> usize {
            self.consumed.len()
        }
        fn snapshot(&self) -> Box<dyn Sequence> {
            Box::new(Tokens {
                consumed: self.consumed.clone(),
                bytes_per_token: self.bytes_per_token,
            })
        }
        fn byte_size(&self) -> usize {
            self.consumed.len() * self.bytes_per_token
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    fn state(tokens: &[u32]) -> Box<dyn Sequence> {
        Box::new(Tokens {
            consumed: tokens.to_vec(),
            bytes_per_token: 10,
        })
    }

    fn consumed(s: &dyn Sequence) -> Vec<u32> {
        s.as_any()
            .downcast_ref::<Tokens>()
            .unwrap()
            .consumed
            .clone()
    }

    #[test]
    fn longest_strict_prefix_wins_and_is_a_copy() {
        let mut cache = PrefixCache::new(1000);
        cache.insert(vec![1, 2], state(&[1, 2]));
        cache.insert(vec![1, 2, 3, 4], state(&[1, 2, 3, 4]));
        cache.insert(vec![9], state(&[9]));
        let (len, s) = cache.lookup(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!((len, consumed(s.as_ref())), (4, vec![1, 2, 3, 4]));
        // the same prompt: the 4-token entry would leave nothing to run, so the 2-token one is used
        let (len, _) = cache.lookup(&[1, 2, 3, 4]).unwrap();
        assert_eq!(len, 2);
        assert!(cache.lookup(&[2, 1]).is_none());
        assert!(cache.lookup(&[1]).is_none());
        let stats = cache.stats();
        assert_eq!((stats.queries, stats.hits, stats.hit_tokens), (4, 2, 6));
        assert_eq!(stats.entries, 3);
    }

    #[test]
    fn memory_budget_evicts_least_recently_used() {
        let mut cache = PrefixCache::new(100); // 10 tokens' worth
        cache.insert(vec![1, 1, 1], state(&[1, 1, 1])); // 30 bytes
        cache.insert(vec![2, 2, 2], state(&[2, 2, 2])); // 60
        cache.insert(vec![3, 3, 3], state(&[3, 3, 3])); // 90
        assert!(cache.lookup(&[1, 1, 1, 0]).is_some()); // 1 is now the most recent
        cache.insert(vec![4, 4, 4], state(&[4, 4, 4])); // needs 30: evicts 2
        assert!(cache.lookup(&[2, 2, 2, 0]).is_none());
        assert!(cache.lookup(&[1, 1, 1, 0]).is_some());
        assert!(cache.lookup(&[3, 3, 3, 0]).is_some());
        assert_eq!(cache.stats().bytes, 90);
        // larger than the budget: not kept, nothing evicted
        let big: Vec<u32> = (0..11).collect();
        cache.insert(big.clone(), state(&big));
        assert_eq!(cache.stats().entries, 3);
        assert!(cache.stats().bytes <= 100);
    }

    #[test]
    fn zero_budget_keeps_nothing() {
        let mut cache = PrefixCache::new(0);
        cache.insert(vec![1], state(&[1]));
        assert!(cache.lookup(&[1, 2]).is_none());
    }
}
