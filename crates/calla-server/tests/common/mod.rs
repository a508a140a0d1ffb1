//! Shared by the server's integration tests: a server on a loopback port, a minimal HTTP/1.0 client
//! (requests, SSE streams), and a scripted test-double backend whose reply is a function of the
//! prompt, so concurrent requests and parsers can be checked exactly.

#![allow(dead_code)]

use std::any::Any;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use calla_chat::ChatTemplate;
use calla_engine::scheduler::{Scheduler, SchedulerConfig};
use calla_engine::{Backend, Selection, Sequence, TokenChoice};
use calla_model::load::GenerationDefaults;
use calla_model::{Family, FeedForwardSpec, ModelSpec};
use calla_server::{AppState, Runtime, ServerConfig, TextCodec};
use serde_json::Value as Json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

// ---------------------------------------------------------------------------------------------------
// Byte codec: ids 0..256 are bytes, 256 is EOS (a special token, never text).

pub const EOS: u32 = 256;

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
            "<eos>".into()
        }
    }
    fn vocab_size(&self) -> usize {
        257
    }
    fn vocab_bytes(&self) -> Option<Vec<Vec<u8>>> {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(calla_server::structured::special_bytes("<eos>"));
        Some(words)
    }
}

// ---------------------------------------------------------------------------------------------------
// Scripted backend: the reply to a prompt is `script(prompt text)`, one byte per step, then EOS.

/// What the model "says" to a rendered Qwen chat prompt (or a raw completion prompt).
pub fn script(prompt: &str) -> String {
    let user = prompt
        .rsplit("<|im_start|>user\n")
        .next()
        .and_then(|rest| rest.split("<|im_end|>").next())
        .unwrap_or(prompt)
        .to_string();
    let thinking = prompt.ends_with("<think>\n");
    let call = |name: &str, city: &str| {
        format!("<tool_call>\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    };
    let answer = if prompt.contains("<tools>") && user.contains("twice") {
        format!(
            "{}\n{}",
            call("get_weather", "Paris"),
            call("get_weather", "Rome")
        )
    } else if prompt.contains("<tools>") && user.contains("undeclared") {
        format!(
            "{}\n{}",
            call("launch_rockets", "Paris"),
            call("get_weather", "Rome")
        )
    } else if let Some(raw) = user.strip_prefix("raw ") {
        raw.to_string()
    } else if let Some(json) = user.strip_prefix("json ") {
        format!("Here: {json}")
    } else if prompt.contains("<tools>") && user.contains("weather") {
        "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>".to_string()
    } else if let Some(n) = user.strip_prefix("long ") {
        "a".repeat(n.trim().parse().unwrap_or(100))
    } else if !prompt.contains("<|im_start|>") {
        format!(" continued({})", prompt.len())
    } else {
        format!("You said: {user}")
    };
    if thinking {
        format!("Let me think about {user}.\n</think>\n\n{answer}")
    } else {
        answer
    }
}

pub struct Steps(pub Arc<AtomicUsize>);

pub struct ScriptBackend {
    spec: ModelSpec,
    pub steps: Arc<AtomicUsize>,
    pub step_delay: Duration,
}

/// The tokens consumed, and where the prompt ended (known at the first `forward_logits`).
struct History(Vec<u32>, Option<usize>);
impl Sequence for History {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn snapshot(&self) -> Box<dyn Sequence> {
        // The prompt boundary belongs to the request: a prefix-cache entry restored for another
        // request learns its own at that request's first forward_logits.
        Box::new(History(self.0.clone(), None))
    }
    fn byte_size(&self) -> usize {
        4 * self.0.len() + 64
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub fn byte_spec(max_context: usize) -> ModelSpec {
    ModelSpec {
        family: Family::Qwen35Moe,
        vocab_size: 257,
        hidden_size: 8,
        layers: vec![],
        rms_norm_eps: 1e-6,
        num_attention_heads: 1,
        num_key_value_heads: 1,
        head_dim: 8,
        rotary_dim: 2,
        rope_theta: 1e4,
        attn_output_gate: true,
        linear_num_key_heads: 1,
        linear_num_value_heads: 1,
        linear_key_head_dim: 8,
        linear_value_head_dim: 8,
        linear_conv_kernel_dim: 4,
        feed_forward: FeedForwardSpec::Dense { intermediate: 8 },
        tie_word_embeddings: false,
        max_position_embeddings: max_context,
        eos_token_ids: vec![EOS],
    }
}

impl Backend for ScriptBackend {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn describe(&self) -> String {
        "script".into()
    }
    fn new_sequence(&mut self) -> anyhow::Result<Box<dyn Sequence>> {
        Ok(Box::new(History(Vec::new(), None)))
    }
    fn step(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
        sel: &Selection,
    ) -> anyhow::Result<TokenChoice> {
        std::thread::sleep(self.step_delay);
        self.steps.fetch_add(1, Ordering::SeqCst);
        let history = &mut seq.as_any_mut().downcast_mut::<History>().unwrap().0;
        history.extend_from_slice(tokens);
        // The state must hold exactly the prompt, then the generated tokens fed back.
        let expected: Vec<u32> = sel.prompt.iter().chain(sel.generated).copied().collect();
        if history.len() >= sel.prompt.len() {
            anyhow::ensure!(
                history[..] == expected[..history.len()],
                "sequence state diverged"
            );
        }
        let reply = script(&ByteCodec.decode(sel.prompt));
        let bytes = reply.as_bytes();
        let token = if history.len() < sel.prompt.len() {
            0 // a prefill chunk: the choice is discarded
        } else {
            bytes.get(sel.generated.len()).map_or(EOS, |&b| b as u32)
        };
        let top = (0..sel.top_logprobs as u32)
            .map(|i| {
                (
                    if i == 0 { token } else { (token + i) % 256 },
                    -(i as f32) - 0.25,
                )
            })
            .collect();
        Ok(TokenChoice {
            token,
            logprob: -0.25,
            top,
        })
    }
    /// Constrained steps (the server's grammars) come here: the script's next byte gets the
    /// highest logit, where the script is the reply, or the reply with its answer from its first
    /// `<tool_call>` or `{` on (the grammar skips a preamble), whichever the text so far follows;
    /// off script, EOS.
    fn forward_logits(
        &mut self,
        seq: &mut dyn Sequence,
        tokens: &[u32],
    ) -> anyhow::Result<Vec<f32>> {
        std::thread::sleep(self.step_delay);
        self.steps.fetch_add(1, Ordering::SeqCst);
        let history = seq.as_any_mut().downcast_mut::<History>().unwrap();
        history.0.extend_from_slice(tokens);
        let prompt_len = *history.1.get_or_insert(history.0.len());
        let (prompt, generated) = history.0.split_at(prompt_len);
        let reply = script(&ByteCodec.decode(prompt));
        let generated: Vec<u8> = generated
            .iter()
            .filter(|&&t| t < 256)
            .map(|&t| t as u8)
            .collect();
        // The reasoning stays; the answer's preamble may be skipped.
        let think_end = reply
            .find("</think>\n\n")
            .map_or(0, |i| i + "</think>\n\n".len());
        let (head, answer) = reply.split_at(think_end);
        let candidates: Vec<String> = [Some(0), answer.find("<tool_call>"), answer.find('{')]
            .into_iter()
            .flatten()
            .map(|at| format!("{head}{}", &answer[at..]))
            .collect();
        let next = candidates
            .iter()
            .map(|c| c.as_bytes())
            .find(|c| c.starts_with(&generated))
            .map(|c| c.get(generated.len()).map_or(EOS, |&b| b as u32));
        let mut logits = vec![0.0; 257];
        logits[EOS as usize] = 1.0;
        if let Some(next) = next {
            logits[next as usize] = 10.0;
        }
        Ok(logits)
    }
}

/// The scripted backend on its own (vocab 257), for tests that build a runtime themselves.
pub fn script_backend(max_context: usize) -> ScriptBackend {
    ScriptBackend {
        spec: byte_spec(max_context),
        steps: Arc::new(AtomicUsize::new(0)),
        step_delay: Duration::ZERO,
    }
}

pub struct Options {
    pub config: ServerConfig,
    pub step_delay: Duration,
    pub max_queue: usize,
    pub max_context: usize,
    pub prefix_cache_bytes: usize,
    pub ready: bool,
    /// Default: the byte codec.
    pub codec: Option<Arc<dyn TextCodec>>,
    /// Default: the Qwen3.6 template.
    pub template: Option<ChatTemplate>,
    /// The model's vocabulary (its embedding rows); more than the codec's 257 means padding rows.
    pub model_vocab: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            config: ServerConfig {
                served_model_name: "test-model".into(),
                ..ServerConfig::default()
            },
            step_delay: Duration::ZERO,
            max_queue: 64,
            max_context: 4096,
            prefix_cache_bytes: 1 << 20,
            ready: true,
            codec: None,
            template: None,
            model_vocab: 257,
        }
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    pub steps: Arc<AtomicUsize>,
    runtime: Option<Runtime>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TestServer {
    pub fn make_ready(&mut self) {
        if let Some(rt) = self.runtime.take() {
            self.state.set_ready(rt);
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// The official Qwen3.6 template (the fixtures' copy).
pub fn qwen_template() -> ChatTemplate {
    ChatTemplate::from_dir(&repo_root().join("tests/fixtures/chat")).expect("fixture template")
}

pub async fn start(opts: Options) -> TestServer {
    let steps = Arc::new(AtomicUsize::new(0));
    let mut spec = byte_spec(opts.max_context);
    spec.vocab_size = opts.model_vocab;
    let backend = ScriptBackend {
        spec,
        steps: Arc::clone(&steps),
        step_delay: opts.step_delay,
    };
    let scheduler = Scheduler::start(
        Box::new(backend),
        SchedulerConfig {
            max_queue: opts.max_queue,
            prefix_cache_bytes: opts.prefix_cache_bytes,
            max_context: opts.max_context,
        },
    );
    let runtime = Runtime {
        scheduler,
        codec: opts.codec.unwrap_or_else(|| Arc::new(ByteCodec)),
        template: Some(opts.template.unwrap_or_else(qwen_template)),
        defaults: GenerationDefaults {
            temperature: Some(0.0),
            ..Default::default()
        },
        max_context: opts.max_context,
    };
    serve_runtime(opts.config, runtime, opts.ready)
        .await
        .with_steps(steps)
}

impl TestServer {
    fn with_steps(mut self, steps: Arc<AtomicUsize>) -> TestServer {
        self.steps = steps;
        self
    }
}

/// Serve `runtime` on a free loopback port (ready now, or on `make_ready`).
pub async fn serve_runtime(config: ServerConfig, runtime: Runtime, ready: bool) -> TestServer {
    let state = AppState::new(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(calla_server::serve(
        listener,
        Arc::clone(&state),
        async move {
            let _ = rx.await;
        },
    ));
    let mut server = TestServer {
        addr,
        state,
        steps: Arc::new(AtomicUsize::new(0)),
        runtime: Some(runtime),
        shutdown: Some(tx),
    };
    if ready {
        server.make_ready();
    }
    server
}

// ---------------------------------------------------------------------------------------------------
// HTTP/1.0 client: the response body runs to the end of the connection, so no chunked decoding.

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Json {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

async fn send_head(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> BufReader<TcpStream> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    // The body may be refused before it is all written (413): ignore write errors then.
    let _ = stream.write_all(body).await;
    BufReader::new(stream)
}

async fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).await.unwrap();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        let trimmed = line.trim_end();
        if trimmed.is_empty() {
            break;
        }
        if let Some((k, v)) = trimmed.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut reader = send_head(addr, method, path, headers, body).await;
    let (status, headers) = read_head(&mut reader).await;
    let mut body = String::new();
    reader.read_to_string(&mut body).await.unwrap();
    Response {
        status,
        headers,
        body,
    }
}

pub async fn post(addr: SocketAddr, path: &str, body: &Json) -> Response {
    request(addr, "POST", path, &[], body.to_string().as_bytes()).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Response {
    request(addr, "GET", path, &[], b"").await
}

/// An open SSE response.
pub struct SseStream {
    pub status: u16,
    reader: BufReader<TcpStream>,
}

impl SseStream {
    /// The next `data:` payload; None at the end of the stream.
    pub async fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.reader.read_line(&mut line).await.ok()?;
            if n == 0 {
                return None;
            }
            if let Some(data) = line.trim_end_matches(['\r', '\n']).strip_prefix("data: ") {
                return Some(data.to_string());
            }
            // comments (keep-alive), event names and blank separators are skipped
        }
    }

    /// Every `data:` payload to the end; the last must be `[DONE]`, which is not returned.
    pub async fn collect_json(mut self) -> Vec<Json> {
        let mut chunks = Vec::new();
        let mut done = false;
        while let Some(data) = self.next_data().await {
            assert!(!done, "data after [DONE]: {data}");
            if data == "[DONE]" {
                done = true;
                continue;
            }
            chunks.push(serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}")));
        }
        assert!(done, "the stream did not end with [DONE]: {chunks:?}");
        chunks
    }
}

pub async fn open_stream(addr: SocketAddr, path: &str, body: &Json) -> SseStream {
    let mut reader = send_head(addr, "POST", path, &[], body.to_string().as_bytes()).await;
    let (status, headers) = read_head(&mut reader).await;
    if status == 200 {
        let content_type = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
    }
    SseStream { status, reader }
}

/// Concatenate a field of the deltas of choice `index` across chunks.
pub fn delta_text(chunks: &[Json], index: usize, field: &str) -> String {
    chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["index"] == index)
        .filter_map(|c| c["delta"][field].as_str().map(str::to_owned))
        .collect()
}

pub fn user(text: &str) -> Json {
    serde_json::json!([{"role": "user", "content": text}])
}
