//! Driving a request's engine events into a reply: as Server-Sent Events (`data: {json}` chunks, a
//! keep-alive comment while the prompt runs, `data: [DONE]` at the end, `data: {"error": …}` if the
//! engine fails after the 200 header went out), or collected into one JSON body.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value as Json;

use crate::errors::ApiError;
use crate::generation::{Events, GenEvent};

pub enum Flow {
    /// Chunks to send; more events follow.
    Chunks(Vec<Json>),
    /// Every choice finished: the last chunks (finish, usage), then `[DONE]`.
    Done(Vec<Json>),
    /// The engine failed: this error ends the reply.
    Failed(ApiError),
}

/// An endpoint's reply under construction, fed with the engine's events in order.
pub trait Reply: Send + 'static {
    fn on_event(&mut self, choice: usize, event: GenEvent) -> Flow;
    /// One chunk as an SSE event: `data: {json}` (OpenAI chat and completions); protocols with
    /// named events (Anthropic, Responses) add `event: {type}`.
    fn sse_event(&self, chunk: &Json) -> Event {
        data(chunk)
    }
    /// What ends a finished stream: `data: [DONE]`, or nothing.
    fn done_event(&self) -> Option<Event> {
        Some(Event::default().data("[DONE]"))
    }
    /// An engine failure after the 200 header.
    fn error_event(&self, error: &ApiError) -> Event {
        data(&error.body())
    }
}

/// `event: {chunk.type}` + `data: {chunk}`.
pub fn typed_event(chunk: &Json) -> Event {
    let kind = chunk
        .get("type")
        .and_then(Json::as_str)
        .unwrap_or("message");
    Event::default().event(kind).data(chunk.to_string())
}

/// Collect a non-streamed reply: returns once every choice has finished.
pub async fn collect(events: &mut Events, reply: &mut impl Reply) -> Result<(), ApiError> {
    while let Some((choice, event)) = events.recv().await {
        match reply.on_event(choice, event) {
            Flow::Chunks(_) => {}
            Flow::Done(_) => return Ok(()),
            Flow::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal(
        "the engine stopped before the request finished",
    ))
}

struct StreamState<R> {
    events: Events,
    reply: R,
    queue: VecDeque<Event>,
    ended: bool,
}

fn data(json: &Json) -> Event {
    Event::default().data(json.to_string())
}

/// Stream a reply as SSE; `first` chunks go out at once (the role chunk), so headers and a first byte
/// reach the client before the prompt has run. Dropping the stream (client gone) drops the event
/// channel, which cancels the engine's work.
pub fn stream(events: Events, reply: impl Reply, first: Vec<Json>) -> Response {
    let state = StreamState {
        queue: first.iter().map(|c| reply.sse_event(c)).collect(),
        events,
        reply,
        ended: false,
    };
    let body = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(event) = st.queue.pop_front() {
                return Some((Ok::<Event, Infallible>(event), st));
            }
            if st.ended {
                return None;
            }
            let next = st.events.recv().await;
            let flow = match next {
                Some((choice, event)) => st.reply.on_event(choice, event),
                None => Flow::Failed(ApiError::internal(
                    "the engine stopped before the request finished",
                )),
            };
            match flow {
                Flow::Chunks(chunks) => {
                    for c in &chunks {
                        let event = st.reply.sse_event(c);
                        st.queue.push_back(event);
                    }
                }
                Flow::Done(chunks) => {
                    for c in &chunks {
                        let event = st.reply.sse_event(c);
                        st.queue.push_back(event);
                    }
                    st.queue.extend(st.reply.done_event());
                    st.ended = true;
                }
                Flow::Failed(error) => {
                    let event = st.reply.error_event(&error);
                    st.queue.push_back(event);
                    st.ended = true;
                }
            }
        }
    });
    Sse::new(body)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(5)))
        .into_response()
}
