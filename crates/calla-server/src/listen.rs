//! The accept loop: HTTP/1 connections with a header/idle timeout, a write-stall timeout, a cap on
//! open connections, and a graceful shutdown that has a deadline.
//!
//! `axum::serve` has none of these, so a slow or stalled client could hold a connection (and a file
//! descriptor) for ever, and one half-sent request kept SIGTERM waiting. Here:
//! - the head of every request, and the wait for the next one on a kept-alive connection, must arrive
//!   within [`Limits::header_timeout`] (hyper's `header_read_timeout`);
//! - the body must arrive within [`Limits::body_timeout`] (the `read_body` middleware, routes.rs);
//! - a write that cannot make progress for [`Limits::write_timeout`] (a client that stopped
//!   reading) closes the connection;
//! - above [`Limits::max_connections`] a new connection gets an immediate JSON 503 and is closed;
//! - on shutdown, open connections finish their current request within
//!   [`Limits::shutdown_deadline`]; what is still open then is dropped (which cancels its work).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Sleep;

use crate::errors::ApiError;
use crate::routes::router;
use crate::state::AppState;

/// Connection-level limits (the defaults suit a local server; all are flags of `calla serve`).
#[derive(Debug, Clone)]
pub struct Limits {
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub write_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_deadline: Duration,
    /// Longest request target (path + query); longer gets 414.
    pub max_uri_bytes: usize,
    /// Most bytes of all header names and values; more gets 431.
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
            max_connections: 512,
            shutdown_deadline: Duration::from_secs(30),
            max_uri_bytes: 8 << 10,
            max_header_bytes: 32 << 10,
        }
    }
}

/// Serve on `listener` until `shutdown` completes, then drain for at most the shutdown deadline.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let limits = state.config.limits.clone();
    let app = router(Arc::clone(&state));
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and friends: wait for descriptors to come back rather than spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            // Reap finished connection tasks so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            tracing::warn!(
                "{peer}: refused, {} connections are open (--max-connections)",
                limits.max_connections
            );
            connections.spawn(refuse(stream));
            continue;
        };
        let dispatched = Arc::new(AtomicUsize::new(0));
        let io = TokioIo::new(WriteTimeout::new(
            stream,
            limits.write_timeout,
            Arc::clone(&dispatched),
        ));
        let service = Counted {
            inner: TowerToHyperService::new(app.clone()),
            dispatched,
        };
        let mut stop = stop_rx.clone();
        let header_timeout = limits.header_timeout;
        connections.spawn(async move {
            let _permit = permit;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(256 << 10);
            let conn = builder.serve_connection(io, service);
            tokio::pin!(conn);
            let result = tokio::select! {
                r = conn.as_mut() => r,
                _ = async { drop(stop.wait_for(|s| *s).await) } => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!("{peer}: connection ended: {e}");
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let open = connections.len();
    if open > 0 {
        tracing::info!(
            "waiting up to {:.0} s for {open} open connection(s)",
            limits.shutdown_deadline.as_secs_f64()
        );
    }
    let drained = tokio::time::timeout(limits.shutdown_deadline, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            "shutdown deadline passed: closing {} connection(s)",
            connections.len()
        );
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    }
    Ok(())
}

/// Over the connection cap: a JSON 503, then close (bounded in time, whatever the client does).
async fn refuse(mut stream: tokio::net::TcpStream) {
    let body = ApiError::overloaded().body().to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = stream.write_all(response.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// The router, counting the requests hyper hands it (so the stream below can tell a response to
/// a request from one hyper wrote itself for a request it could not parse).
struct Counted<S> {
    inner: S,
    dispatched: Arc<AtomicUsize>,
}

impl<R, S: hyper::service::Service<R>> hyper::service::Service<R> for Counted<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;
    fn call(&self, request: R) -> S::Future {
        self.dispatched.fetch_add(1, Ordering::SeqCst);
        self.inner.call(request)
    }
}

/// The connection's stream: writes fail with `TimedOut` once one has been pending for `limit` (a
/// client that stopped reading its response), and the bodiless error responses hyper writes for
/// requests it cannot parse (400, 414, 431, 505) get an OpenAI-shaped JSON body.
struct WriteTimeout<S> {
    inner: S,
    limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
    /// Requests given to the router.
    dispatched: Arc<AtomicUsize>,
    /// Response heads written so far.
    heads: usize,
    /// A replacement for hyper's own error response, and how much of it is written.
    replacement: Option<(Vec<u8>, usize)>,
}

impl<S> WriteTimeout<S> {
    fn new(inner: S, limit: Duration, dispatched: Arc<AtomicUsize>) -> Self {
        WriteTimeout {
            inner,
            limit,
            stalled: None,
            dispatched,
            heads: 0,
            replacement: None,
        }
    }

    /// Whether `buf` starts a final response head (not an interim 1xx such as 100 Continue, which
    /// comes before its request's head).
    fn is_response_head(buf: &[u8]) -> bool {
        buf.starts_with(b"HTTP/1.") && buf.get(9) != Some(&b'1')
    }

    /// The JSON twin of hyper's own error response whose head starts `buf`.
    fn hyper_error_body(buf: &[u8]) -> Option<Vec<u8>> {
        let line_end = buf.windows(2).position(|w| w == b"\r\n")?;
        let status_line = std::str::from_utf8(&buf[..line_end]).ok()?;
        let code: u16 = status_line.split_whitespace().nth(1)?.parse().ok()?;
        let message = match code {
            414 => "The request target is too long.",
            431 => "The request headers are too large.",
            505 => "Only HTTP/1.0 and HTTP/1.1 are supported.",
            408 => "The request headers did not arrive in time.",
            _ => "The request could not be parsed as HTTP/1.1.",
        };
        let body = serde_json::json!({"error": {
            "message": message, "type": "invalid_request_error", "param": null, "code": null,
        }})
        .to_string();
        Some(
            format!(
                "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                 connection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )
    }

    /// Called when the inner write is pending: arm the timer, or report that it ran out.
    fn pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client stopped reading",
            )),
            Poll::Pending => Poll::Pending,
        }
    }

    fn track<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match poll {
            Poll::Pending => self.pending(cx).map(Err),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteTimeout<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // A head is counted once its bytes are taken (hyper offers the same buffer again after a
        // pending write); one no request was dispatched for is hyper's own error.
        let head = self.replacement.is_none() && Self::is_response_head(buf);
        if head && self.heads + 1 > self.dispatched.load(Ordering::SeqCst) {
            if let Some(bytes) = Self::hyper_error_body(buf) {
                self.heads += 1;
                self.replacement = Some((bytes, 0));
            }
        }
        // Hyper's own error response: write the replacement instead, then report `buf` written.
        while let Some((bytes, done)) = self.replacement.take() {
            if done == bytes.len() {
                // Everything after a hyper error (nothing, normally) is dropped: the
                // connection closes.
                self.replacement = Some((bytes, done));
                return Poll::Ready(Ok(buf.len()));
            }
            let poll = Pin::new(&mut self.inner).poll_write(cx, &bytes[done..]);
            match self.track(cx, poll) {
                Poll::Ready(Ok(n)) => self.replacement = Some((bytes, done + n)),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    self.replacement = Some((bytes, done));
                    return Poll::Pending;
                }
            }
        }
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        let poll = self.track(cx, poll);
        if head && matches!(poll, Poll::Ready(Ok(n)) if n > 0) {
            self.heads += 1;
        }
        poll
    }

    // Not vectored: hyper then hands each response over as one buffer starting with its head,
    // which is what the error replacement above looks at.
    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.track(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.track(cx, poll)
    }
}
