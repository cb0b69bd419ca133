//! The book (`docs/`, an mdBook) and the README held to the code: the configuration
//! page is what `idemproxy config reference` prints; every page is in `SUMMARY.md` and
//! every internal link lands on a page and a heading that exist; and the commands of
//! the getting-started page and the README's walk-through run as they are written,
//! against a fresh toy upstream and proxy, printing what the page shows.
//!
//! The walk-throughs use the ports `proxy.toml` names (8080, 9090, 9000), as a reader
//! does; the two tests that run them take turns.

// A test that cannot set itself up should fail loudly, with the reason.
#![allow(clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("read {}: {error}", path.display()))
}

#[test]
fn the_configuration_page_is_what_config_reference_prints() {
    let output = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["config", "reference"])
        .output()
        .expect("run idemproxy config reference");
    assert!(output.status.success());
    let printed = String::from_utf8(output.stdout).expect("UTF-8");
    let page = read(&root().join("docs/configuration.md"));
    assert!(
        page == printed,
        "docs/configuration.md is not what `idemproxy config reference` prints: run\n    \
         cargo run -- config reference > docs/configuration.md"
    );
}

/// Each line of `text` with whether it is code: in a fenced block, or in an indented
/// block (four spaces, after a blank line or more of the block).
fn lines(text: &str) -> Vec<(&str, bool)> {
    let mut out = Vec::new();
    let (mut fenced, mut indented, mut previous_blank) = (false, false, true);
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push((line, true));
            continue;
        }
        let blank = line.trim().is_empty();
        if line.starts_with("    ") && (indented || previous_blank) {
            indented = true;
        } else if !blank {
            indented = false;
        }
        out.push((line, fenced || indented));
        previous_blank = blank;
    }
    out
}

/// The lines of `text` outside code.
fn prose(text: &str) -> Vec<&str> {
    lines(text)
        .into_iter()
        .filter(|(_, code)| !code)
        .map(|(line, _)| line)
        .collect()
}

/// The ids mdBook gives a page's headings: lower case, letters, digits, `_` and `-`
/// kept, spaces made `-`, the rest dropped; a repeated one gets `-1`, `-2`.
fn heading_ids(text: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for line in prose(text) {
        let Some(heading) = line.strip_prefix('#').map(|rest| rest.trim_start_matches('#')) else {
            continue;
        };
        if !heading.starts_with(' ') {
            continue;
        }
        let id: String = heading
            .trim()
            .chars()
            .filter_map(|c| match c {
                c if c.is_alphanumeric() || c == '_' || c == '-' => Some(c.to_ascii_lowercase()),
                c if c.is_whitespace() => Some('-'),
                _ => None,
            })
            .collect();
        let count = seen.entry(id.clone()).or_default();
        ids.insert(if *count == 0 {
            id.clone()
        } else {
            format!("{id}-{count}")
        });
        *count += 1;
    }
    ids
}

/// Every `[text](target)` in the prose of `text`.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_page_is_in_the_summary_and_every_internal_link_resolves() {
    let docs = root().join("docs");
    let summary = read(&docs.join("SUMMARY.md"));
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    let pages: BTreeSet<String> = std::fs::read_dir(&docs)
        .expect("list docs/")
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.ends_with(".md") && name != "SUMMARY.md")
        .collect();
    assert_eq!(listed, pages, "the pages in docs/ and the ones SUMMARY.md lists");
    let mut sources: Vec<(PathBuf, String)> = pages
        .iter()
        .map(|page| (docs.join(page), read(&docs.join(page))))
        .collect();
    sources.push((root().join("README.md"), read(&root().join("README.md"))));
    let mut broken = Vec::new();
    let mut checked = 0;
    for (path, text) in &sources {
        let dir = path.parent().expect("a directory");
        for link in links(text) {
            if link.starts_with("http://") || link.starts_with("https://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() { path.clone() } else { dir.join(file) };
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", path.display()));
                continue;
            }
            if !anchor.is_empty() && !heading_ids(&read(&target)).contains(anchor) {
                broken.push(format!("{}: {link}: no such heading", path.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 30, "only {checked} internal links found");
}

/// One command of a walk-through and the output its page shows.
#[derive(Debug)]
struct Step {
    command: String,
    background: bool,
    shown: Vec<String>,
}

/// The `$ ` commands of `text`'s indented blocks, in order, each with the lines shown
/// after it (until the next command or the block's end).
fn steps(text: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut open = false;
    for (line, code) in lines(text) {
        let Some(code_line) = line.strip_prefix("    ").filter(|_| code) else {
            if !line.trim().is_empty() {
                open = false;
            }
            continue;
        };
        // A command continued on the next line (`\` at its end) is one command.
        if let Some(step) = steps.last_mut()
            && step.command.ends_with('\\')
            && step.shown.is_empty()
        {
            step.command.pop();
            step.command.push_str(code_line.trim_start());
            step.background = step.command.ends_with(" &");
            if step.background {
                step.command.truncate(step.command.len() - 2);
            }
            continue;
        }
        if let Some(command) = code_line.strip_prefix("$ ") {
            steps.push(Step {
                command: command.trim_end_matches(" &").to_string(),
                background: command.ends_with(" &"),
                shown: Vec::new(),
            });
            open = true;
        } else if open
            && !code_line.trim().is_empty()
            && let Some(step) = steps.last_mut()
        {
            step.shown.push(code_line.to_string());
        }
    }
    steps
}

/// The processes a walk-through started, stopped with it.
struct Started(Vec<Child>);

impl Drop for Started {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn connects(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

fn until(what: &str, done: impl Fn() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < Duration::from_secs(20), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn guarded_in_flight() -> f64 {
    let Ok(output) = Command::new("curl").args(["-s", "localhost:9090/metrics"]).output() else {
        return 0.0;
    };
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("idemproxy_guarded_requests_in_flight ")?.parse().ok())
        .unwrap_or(0.0)
}

/// The walk-throughs share their ports: one at a time.
static PORTS: Mutex<()> = Mutex::new(());

/// A fresh copy of what a walk-through reads from a clone (`proxy.toml` and
/// `examples/`), so that the SQLite file `proxy.toml` names starts empty and is left
/// behind in no checkout.
fn fresh_clone() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::copy(root().join("proxy.toml"), dir.path().join("proxy.toml")).expect("proxy.toml copied");
    std::fs::create_dir(dir.path().join("examples")).expect("examples/ made");
    for entry in std::fs::read_dir(root().join("examples")).expect("examples/ listed") {
        let entry = entry.expect("an entry of examples/");
        if entry.file_type().expect("its type").is_file() {
            std::fs::copy(entry.path(), dir.path().join("examples").join(entry.file_name()))
                .expect("an example copied");
        }
    }
    dir
}

/// Runs `page`'s commands as written, in a fresh copy of the clone's files: the built
/// binary for `cargo run --release --`, setup commands in the background (waited for
/// until their port answers), a request sent with `&` in the background (waited for
/// until the proxy holds it), `pkill` waited for until the proxy's port is closed, and
/// every other command's output held to what the page shows.
fn run_as_written(page: &Path) {
    let _ports = PORTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for port in [8080, 9090, 9000] {
        assert!(
            !connects(port),
            "port {port} is taken: {} runs on the ports proxy.toml names",
            page.display()
        );
    }
    let steps = steps(&read(page));
    assert!(
        steps.len() >= 4,
        "{}: only {} commands found",
        page.display(),
        steps.len()
    );
    let binary = env!("CARGO_BIN_EXE_idemproxy");
    let clone = fresh_clone();
    let mut started = Started(Vec::new());
    for step in &steps {
        let command = step.command.replace("cargo run --release --", binary);
        let mut shell = Command::new("bash");
        shell.arg("-c").arg(&command).current_dir(clone.path());
        if step.background {
            let child = shell
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|error| panic!("{command}: {error}"));
            started.0.push(child);
            if command.contains("examples/upstream.py") {
                until("the toy upstream never listened on 9000", || connects(9000));
            } else if command.contains(" serve ") {
                until("the proxy never listened on 8080", || connects(8080) && connects(9090));
            } else {
                until("the request sent in the background never reached the proxy", || {
                    guarded_in_flight() >= 1.0
                });
            }
            continue;
        }
        let output = shell.output().unwrap_or_else(|error| panic!("{command}: {error}"));
        if command.starts_with("pkill ") {
            until("the proxy's port stayed open after pkill", || !connects(8080));
        }
        let printed = String::from_utf8_lossy(&output.stdout).replace('\r', "");
        let lines: Vec<&str> = printed.lines().collect();
        let mut at = 0;
        for shown in &step.shown {
            match lines[at..].iter().position(|line| line == shown) {
                Some(found) => at += found + 1,
                None => panic!(
                    "{}: `{}` did not print, in order, what the page shows: {shown:?} is missing from\n{printed}",
                    page.display(),
                    step.command
                ),
            }
        }
    }
}

#[test]
fn the_getting_started_commands_run_as_written() {
    run_as_written(&root().join("docs/getting-started.md"));
}

#[test]
fn the_two_horizons_walk_through_runs_as_written() {
    run_as_written(&root().join("docs/remember.md"));
}

#[test]
fn the_readmes_walk_through_runs_as_written() {
    run_as_written(&root().join("README.md"));
}
