//! calla-chat: the text side of a chat turn.
//!
//! In: OpenAI messages → [`messages::prepare_messages`] → the checkpoint's own template
//! ([`ChatTemplate`], byte-identical to transformers' `apply_chat_template`) → prompt text.
//! Out: generated text → [`StopMatcher`] (stop strings across token boundaries) → [`OutputParser`]
//! (reasoning between `<think>` tags, Qwen3.5/3.6 `qwen3_coder` tool calls typed by their schema).
//! Every parser is incremental and gives the same result for any split of its input.

pub mod messages;
pub mod output;
pub mod pyjson;
pub mod reasoning;
mod scan;
pub mod stop;
pub mod template;
pub mod tool_parser;

pub use messages::{prepare_messages, MessageError};
pub use output::{OutputConfig, OutputEvent, OutputParser, ParsedOutput, ParsedToolCall};
pub use reasoning::prompt_opens_thinking;
pub use stop::{StopMatcher, StopOutcome};
pub use template::{ChatTemplate, RenderInput, TemplateError};
