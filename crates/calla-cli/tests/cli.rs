//! The `calla` binary's shared behaviour: one set of flags across subcommands, `--device auto`, and
//! quiet exits on a closed pipe.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const FIXTURE: &str = "qwen35moe-causal-perexpert";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(FIXTURE)
}

fn calla(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_calla"))
        .args(args)
        .env_remove("CALLA_PROMPT_PRECISION")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .expect("run calla")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Each flag's block of `calla COMMAND --help` (from its `--flag` line to the next flag's), with
/// its whitespace collapsed (clap lays a short help out on one line, a long one on several).
fn help_blocks(command: &str) -> BTreeMap<String, String> {
    let out = calla(&[command, "--help"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut blocks = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in text(&out.stdout).lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("--") || trimmed.starts_with("-h,") || trimmed.starts_with("-V,") {
            if let Some((name, block)) = current.take() {
                blocks.insert(name, collapse(&block));
            }
            let name = trimmed
                .split([' ', '=', '<'])
                .next()
                .unwrap_or_default()
                .to_string();
            current = Some((name, String::new()));
        }
        if let Some((_, block)) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
        }
    }
    if let Some((name, block)) = current {
        blocks.insert(name, collapse(&block));
    }
    blocks
}

fn collapse(block: &str) -> String {
    block.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn shared_flags_are_the_same_in_every_command() {
    let shared: &[(&str, &[&str])] = &[
        (
            "--model",
            &["inspect", "generate", "chat", "serve", "bench"],
        ),
        (
            "--quant",
            &["inspect", "generate", "chat", "serve", "bench"],
        ),
        ("--device", &["generate", "chat", "serve", "bench"]),
        ("--kv-cache", &["generate", "chat", "serve", "bench"]),
        (
            "--prompt-precision",
            &["generate", "chat", "serve", "bench"],
        ),
        ("--temperature", &["generate", "chat", "serve", "bench"]),
        ("--top-k", &["generate", "chat", "serve", "bench"]),
        ("--top-p", &["generate", "chat", "serve", "bench"]),
        ("--min-p", &["generate", "chat", "serve", "bench"]),
        ("--max-context", &["chat", "serve"]),
        ("--prefix-cache-mb", &["chat", "serve"]),
        ("--seed", &["generate", "chat"]),
    ];
    let commands = ["inspect", "generate", "chat", "serve", "bench"];
    let helps: BTreeMap<&str, BTreeMap<String, String>> =
        commands.iter().map(|c| (*c, help_blocks(c))).collect();
    for (flag, users) in shared {
        let mut blocks = users.iter().map(|c| {
            (
                *c,
                helps[c]
                    .get(*flag)
                    .unwrap_or_else(|| panic!("calla {c} has no {flag}")),
            )
        });
        let (first, want) = blocks.next().unwrap();
        // --seed's default is the command's own (generate: 0; chat: a fresh one per reply)
        if *flag == "--seed" {
            continue;
        }
        for (command, block) in blocks {
            assert_eq!(
                block, want,
                "{flag}: calla {command} differs from calla {first}"
            );
        }
    }
    assert!(helps["serve"]["--prefix-cache-mb"].contains("[default: 4096]"));
    assert!(helps["generate"]["--device"].contains("[default: auto]"));
}

#[test]
fn device_auto_is_the_default_and_says_what_it_chose() {
    let model = fixture();
    let out = calla(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("--device auto: using"), "{stderr}");
    // without a GPU (CI) the CPU engine runs and the log says why; with one, CUDA
    assert!(
        stderr.contains("using the CPU engine; no usable GPU: ")
            || stderr.contains("using CUDA on"),
        "{stderr}"
    );
    let cpu = calla(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
        "--device",
        "cpu",
    ]);
    assert!(cpu.status.success());
    assert!(!text(&cpu.stderr).contains("--device auto"));
    if stderr.contains("using the CPU engine") {
        assert_eq!(cpu.stdout, out.stdout, "auto on the CPU is the CPU engine");
    }
}

#[test]
fn a_closed_pipe_is_a_quiet_exit() {
    let model = fixture();
    for args in [
        vec!["inspect", "--model", model.to_str().unwrap()],
        vec!["inspect", "--model", model.to_str().unwrap(), "--json"],
        vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "8",
            "--json",
        ],
    ] {
        // the reading end is closed before calla writes anything
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_calla"))
            .args(&args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .output()
            .expect("run calla");
        let stderr = text(&out.stderr);
        assert!(
            !stderr.contains("panicked") && !stderr.contains("error"),
            "{args:?}: {stderr}"
        );
        assert!(out.status.success(), "{args:?}: {:?} {stderr}", out.status);
    }
}

#[test]
fn out_of_range_sampling_flags_fail_before_loading() {
    for command in ["generate", "chat", "serve", "bench"] {
        for (flag, needle) in [
            ("--temperature=-1", "--temperature"),
            ("--top-p=0", "--top-p"),
            ("--min-p=1.5", "--min-p"),
        ] {
            let model = fixture();
            let mut args = vec![command, flag];
            if command == "generate" {
                args.extend(["--model", model.to_str().unwrap(), "--prompt-ids", "1"]);
            }
            if command == "serve" {
                args.extend(["--port", "1"]); // never reached
            }
            let out = calla(&args);
            let stderr = text(&out.stderr);
            assert!(!out.status.success(), "calla {args:?} must fail");
            assert!(
                stderr.contains(needle) && !stderr.contains("panicked"),
                "calla {args:?}: {stderr}"
            );
        }
    }
}

#[test]
fn bench_refuses_the_cpu_engine_and_generate_needs_a_model() {
    let out = calla(&["bench", "--device", "cpu"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("CUDA engine"),
        "{}",
        text(&out.stderr)
    );
    let out = calla(&["generate", "--prompt", "hi"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--model"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn chat_runs_on_the_demo_with_the_shared_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_calla"))
        .args([
            "chat",
            "--device",
            "cpu",
            "--no-think",
            "--max-tokens",
            "4",
            "--temperature",
            "0.8",
            "--top-k",
            "20",
            "--seed",
            "5",
            "--prefix-cache-mb",
            "64",
            "--max-context",
            "256",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(b"Hello\n/exit\n")?;
            drop(stdin);
            child.wait_with_output()
        })
        .expect("run calla chat");
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        !text(&out.stdout).contains("error:"),
        "{}",
        text(&out.stdout)
    );
}
