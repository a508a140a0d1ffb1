//! `calla serve`'s limits: flags that bound what one client can cost (timeouts, connections, prompt
//! size, browsers' access) and the value parsers that refuse a nonsensical value at start instead of
//! wrapping or misbehaving later (`--max-body-mb 17592186044416` used to wrap to 0 and refuse every
//! request; `--max-queue 0` refused every request).

use std::time::Duration;

use calla_server::Limits;

/// A size in MiB, 1 ..= `max`, so that `mib << 20` never wraps.
fn mib_in(s: &str, min: usize, max: usize) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number of MiB"))?;
    if v < min || v > max {
        return Err(format!("must be between {min} and {max} MiB"));
    }
    Ok(v)
}

/// `--max-body-mb`, `--max-prompt-mb`: 1 MiB ..= 4 GiB.
pub fn request_mib(s: &str) -> Result<usize, String> {
    mib_in(s, 1, 4096)
}

/// `--prefix-cache-mb`: 0 (off) ..= 16 TiB.
pub fn cache_mib(s: &str) -> Result<usize, String> {
    mib_in(s, 0, 1 << 24)
}

/// `--max-queue`: 1 ..= 1,000,000.
pub fn queue_len(s: &str) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a count"))?;
    if !(1..=1_000_000).contains(&v) {
        return Err("must be between 1 and 1000000 (0 would refuse every request)".into());
    }
    Ok(v)
}

/// `--max-context`: at least 2 tokens (one prompt token, one generated).
pub fn context_len(s: &str) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a count"))?;
    if !(2..=1 << 24).contains(&v) {
        return Err("must be between 2 and 16777216 tokens".into());
    }
    Ok(v)
}

/// `--max-connections`: 1 ..= 1,000,000.
pub fn connections(s: &str) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a count"))?;
    if !(1..=1_000_000).contains(&v) {
        return Err("must be between 1 and 1000000".into());
    }
    Ok(v)
}

/// A timeout in seconds: 0.01 ..= 86400 (finite).
pub fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.01..=86_400.0).contains(&v) {
        return Err("must be between 0.01 and 86400 seconds".into());
    }
    Ok(Duration::from_secs_f64(v))
}

/// `--cors-origin`: `*`, or `scheme://host[:port]` (no path).
pub fn origin(s: &str) -> Result<String, String> {
    let s = s.trim().trim_end_matches('/');
    if s == "*" {
        return Ok(s.into());
    }
    match s.split_once("://") {
        Some((scheme, rest))
            if matches!(scheme, "http" | "https") && !rest.is_empty() && !rest.contains('/') =>
        {
            Ok(s.to_string())
        }
        _ => Err(format!(
            "{s:?} is not an origin (expected http(s)://host[:port], or *)"
        )),
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeLimits {
    /// Read the weights into memory instead of memory-mapping them: changing or truncating the
    /// checkpoint on disk while serving then cannot corrupt or crash the server (costs load time
    /// and the weights' size in RAM; the CUDA engine releases its map after upload anyway).
    #[arg(long)]
    pub no_mmap: bool,
    /// Let web pages from this origin call the API (repeatable; `*` for any). Without it, only
    /// pages served under the server's own host names may.
    #[arg(long = "cors-origin", value_parser = origin)]
    pub cors_origins: Vec<String>,
    /// Most open connections; more get an immediate 503.
    #[arg(long, default_value = "512", value_parser = connections)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers (also: how long an idle kept-alive
    /// connection stays open).
    #[arg(long, default_value = "10", value_parser = seconds)]
    pub header_timeout_s: Duration,
    /// Seconds a client has to send a request's body; 408 after.
    #[arg(long, default_value = "30", value_parser = seconds)]
    pub body_timeout_s: Duration,
    /// Seconds a response write may stall (a client that stopped reading) before the connection
    /// is closed and its generation cancelled.
    #[arg(long, default_value = "60", value_parser = seconds)]
    pub write_timeout_s: Duration,
    /// Seconds open requests get to finish on shutdown (SIGTERM, Ctrl-C) before they are dropped.
    #[arg(long, default_value = "30", value_parser = seconds)]
    pub shutdown_timeout_s: Duration,
    /// Largest prompt text, in MiB, refused before it is templated or tokenized.
    #[arg(long, default_value = "4", value_parser = request_mib)]
    pub max_prompt_mb: usize,
}

impl ServeLimits {
    pub fn limits(&self) -> Limits {
        Limits {
            header_timeout: self.header_timeout_s,
            body_timeout: self.body_timeout_s,
            write_timeout: self.write_timeout_s,
            max_connections: self.max_connections,
            shutdown_deadline: self.shutdown_timeout_s,
            ..Limits::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_would_wrap_are_refused() {
        assert!(request_mib("17592186044416").is_err());
        assert!(request_mib("0").is_err());
        assert_eq!(request_mib("16"), Ok(16));
        assert!(cache_mib("0").is_ok());
        assert!(cache_mib("18446744073709551615").is_err());
    }

    #[test]
    fn counts_and_times() {
        assert!(queue_len("0").is_err());
        assert_eq!(queue_len("64"), Ok(64));
        assert!(context_len("1").is_err());
        assert!(connections("0").is_err());
        assert!(seconds("0").is_err());
        assert!(seconds("nan").is_err());
        assert!(seconds("inf").is_err());
        assert_eq!(seconds("1.5"), Ok(Duration::from_millis(1500)));
    }

    #[test]
    fn origins() {
        assert_eq!(
            origin("https://app.example/"),
            Ok("https://app.example".into())
        );
        assert!(origin("*").is_ok());
        assert!(origin("app.example").is_err());
        assert!(origin("https://app.example/path").is_err());
        assert!(origin("javascript://x").is_err());
    }
}
