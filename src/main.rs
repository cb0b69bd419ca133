//! The idemproxy binary: parses the command line, sets up logging, and hands over to
//! the library. Start-up and config errors exit non-zero with one clear line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use idemproxy::Config;
use idemproxy::config::TracingConfig;
use idemproxy::records::{self, Answered, RecordedResponse, RecordsAction, RecordsCall, RecordsQuery, Verdict};
use idemproxy::server::{ReloadError, Reloader};
use idemproxy::trace::Export;
use tracing_subscriber::EnvFilter;

/// mimalloc: fewer cycles per request than the system allocator on this workload
/// (see the bench figures in docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "idemproxy", version, about = "A reverse proxy that makes retries safe")]
struct Cli {
    /// How log lines are written to stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        #[arg(long, env = "IDEMPROXY_CONFIG", default_value = "proxy.toml")]
        config: PathBuf,
    },
    /// Validate the config, print the routes, and exit.
    Check {
        #[arg(long, env = "IDEMPROXY_CONFIG", default_value = "proxy.toml")]
        config: PathBuf,
        /// Fresh keys each guarded route takes (`100/s`, `6000/min`, `20000/h`): prints
        /// the records and the store each route's horizon holds at that rate, and warns
        /// where the store's bounds cannot hold them.
        #[arg(long)]
        rate: Option<String>,
    },
    /// Print the published idempotency contract of the config's guarded routes: the
    /// document /.well-known/idempotency serves (json), an OpenAPI 3.1 fragment, or a
    /// Markdown page for an API portal.
    Contract {
        #[arg(long, env = "IDEMPROXY_CONFIG", default_value = "proxy.toml")]
        config: PathBuf,
        #[arg(long, value_enum, default_value_t = ContractFormat::Json)]
        format: ContractFormat,
    },
    /// Run the contract's black-box cases against an endpoint (idemproxy or anything
    /// else) and print one line per case. Exit status: 0 when no case failed, 1
    /// otherwise.
    Conformance {
        /// The endpoint's base URL, e.g. http://127.0.0.1:8080.
        url: String,
        /// The guarded path the cases POST to.
        #[arg(long, default_value = "/")]
        path: String,
        /// A path under the same guard that answers in more than a second, for the
        /// in-flight duplicate case (without it, that case cannot tell).
        #[arg(long, value_name = "PATH")]
        slow_path: Option<String>,
        /// Sent with every request, NAME:VALUE; repeat for each.
        #[arg(long = "header", value_name = "NAME:VALUE")]
        headers: Vec<String>,
        /// The request body: `{}` by default, empty with a form: key.
        #[arg(long)]
        body: Option<String>,
        /// The idempotency key's header (the same as --key-from header:NAME).
        #[arg(long, value_name = "NAME", conflicts_with = "key_from")]
        key_header: Option<String>,
        /// Where to send the key, as the route's `key` names it: header:NAME,
        /// json:/pointer (set in the JSON body), form:NAME (a field of a form body) or
        /// query:NAME.
        #[arg(long, value_name = "SOURCE", default_value = "header:Idempotency-Key")]
        key_from: String,
    },
    /// About the store itself.
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
    /// About the configuration itself.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Show, purge, release or resolve one record through the running proxy's admin
    /// listener (needs admin.token_file). Exit status: 0 done, 3 no such record, 4
    /// release or resolve refused (the record is not unknown), 1 any other failure.
    Records {
        action: RecordsAction,
        /// The route's name.
        #[arg(long)]
        route: String,
        /// The idempotency key, as the client sent it.
        #[arg(long)]
        key: String,
        /// NAME:VALUE for each of the route's scope_headers (jwt.CLAIM for scope_jwt);
        /// repeat for each.
        #[arg(long = "scope", value_name = "NAME:VALUE")]
        scopes: Vec<String>,
        /// Print the admin listener's JSON answer instead.
        #[arg(long)]
        json: bool,
        /// show: the recorded response too, body and fields, opened (by default a
        /// record shows only metadata).
        #[arg(long)]
        body: bool,
        #[command(flatten)]
        resolve: ResolveArgs,
        #[arg(long, env = "IDEMPROXY_CONFIG", default_value = "proxy.toml")]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Print the Postgres store's DDL (tables, functions, and its version row) for the
    /// schema the config names, as one transaction, for a DBA to apply by hand where
    /// `store.migrate = false`. Connects to nothing.
    Schema {
        #[arg(long, env = "IDEMPROXY_CONFIG", default_value = "proxy.toml")]
        config: PathBuf,
    },
    /// Copy every record of the store one config names into the store another names,
    /// with its state, fingerprint, sealed response and remaining lifetimes (records
    /// in flight arrive unknown). A key the target holds keeps the target's record.
    /// Run it again after an interruption: it skips what is there. Progress on
    /// stderr; exit status 1 when anything was not copied.
    Copy {
        /// The config of the store to copy from (not a memory store; a SQLite file
        /// that a running proxy holds is refused).
        #[arg(long)]
        from: PathBuf,
        /// The config of the store to copy into.
        #[arg(long)]
        to: PathBuf,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print every setting the config file takes, with its default and meaning, as
    /// Markdown (the book's configuration page is this output).
    Reference,
}

/// What `records resolve` records: the upstream took the operation (`--applied`, with
/// the response it gave) or did not (`--not-applied`).
#[derive(clap::Args, Debug, Default)]
struct ResolveArgs {
    /// resolve: the operation took effect; record this response for retries to replay.
    #[arg(long, conflicts_with = "not_applied", requires = "status")]
    applied: bool,
    /// resolve: the operation did not take effect; free the key so the next retry runs.
    #[arg(long)]
    not_applied: bool,
    /// resolve --applied: the status the upstream answered.
    #[arg(long, requires = "applied")]
    status: Option<u16>,
    /// resolve --applied: a header of that response, NAME:VALUE; repeat for each.
    #[arg(long = "header", value_name = "NAME:VALUE", requires = "applied")]
    headers: Vec<String>,
    /// resolve --applied: a file holding that response's body (none: empty).
    #[arg(long, value_name = "FILE", requires = "applied")]
    body_file: Option<PathBuf>,
    /// resolve, release: the claim `show` printed, so that what you learned about that
    /// request never lands on a later one of the key (without it: whichever claim is
    /// unknown when the store resolves it).
    #[arg(long, value_name = "HEX")]
    claim: Option<String>,
}

impl ResolveArgs {
    /// The verdict these arguments give for `action`; refused where they do not fit it.
    fn verdict(self, action: RecordsAction) -> anyhow::Result<Option<(Verdict, Option<RecordedResponse>)>> {
        let given = self.applied || self.not_applied;
        match (action, given) {
            (RecordsAction::Resolve, false) => {
                anyhow::bail!("resolve needs --applied (with --status) or --not-applied")
            }
            (RecordsAction::Resolve, true) => {}
            (_, true) => anyhow::bail!("--applied and --not-applied are for resolve"),
            (_, false) => return Ok(None),
        }
        if self.not_applied {
            return Ok(Some((Verdict::NotApplied, None)));
        }
        let mut headers = Vec::with_capacity(self.headers.len());
        for header in &self.headers {
            let (name, value) = header
                .split_once(':')
                .with_context(|| format!("--header {header:?}: give NAME:VALUE"))?;
            headers.push((name.trim().to_string(), value.trim().to_string()));
        }
        let body = match &self.body_file {
            Some(path) => std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?,
            None => Vec::new(),
        };
        use base64::Engine as _;
        let response = RecordedResponse {
            status: self.status.context("--applied needs --status")?,
            headers,
            body: base64::engine::general_purpose::STANDARD.encode(body),
        };
        Ok(Some((Verdict::Applied, Some(response))))
    }
}

/// Exit statuses of `records` that scripts can tell apart.
const EXIT_NOT_FOUND: u8 = 3;
const EXIT_REFUSED: u8 = 4;

#[derive(Clone, Copy, ValueEnum)]
enum ContractFormat {
    Json,
    Openapi,
    Markdown,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// `idemproxy store schema`: the DDL of the Postgres schema the config names.
fn store_schema(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    let idemproxy::config::Backend::Postgres(postgres) = &config.store.backend else {
        anyhow::bail!(
            "{}: store.backend is {:?}; only the postgres backend has a schema to apply",
            path.display(),
            config.store.backend.name()
        );
    };
    let identity = idemproxy::store::postgres::schema::fresh_identity()
        .ok_or_else(|| anyhow::anyhow!("no random source for the schema's key"))?;
    print!(
        "{}",
        idemproxy::store::postgres::schema::script(&postgres.schema, identity)
    );
    Ok(())
}

/// `idemproxy store copy`: every record from one store into another, progress on
/// stderr, the summary on stdout.
fn store_copy(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<ExitCode> {
    let (source, target) = (Config::load(from)?, Config::load(to)?);
    idemproxy::copy::check(&source, &target)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    eprintln!(
        "copying the {} store of {} into the {} store of {}",
        source.store.backend.name(),
        from.display(),
        target.store.backend.name(),
        to.display()
    );
    let copied = runtime.block_on(idemproxy::copy::run(&source, &target, |progress| {
        eprintln!("{progress}");
    }));
    match copied {
        Ok(copied) => {
            println!("copied: {copied}");
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            eprintln!("idemproxy: store copy: {error}");
            Ok(ExitCode::FAILURE)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve` sets up its logging once its config says whether traces are exported.
    if !matches!(cli.command, Command::Serve { .. }) {
        let _ = init_logging(cli.log_format, None);
    }
    let result = match cli.command {
        Command::Check { config, rate } => check(&config, rate.as_deref()),
        Command::Serve { config } => serve(&config, cli.log_format),
        Command::Contract { config, format } => contract(&config, format),
        Command::Conformance {
            url,
            path,
            slow_path,
            headers,
            body,
            key_header,
            key_from,
        } => match key_source(key_header.as_deref(), &key_from)
            .and_then(|source| conformance(url, path, slow_path, &headers, body, source))
        {
            Ok(code) => return code,
            Err(error) => Err(error),
        },
        Command::Store {
            command: StoreCommand::Schema { config },
        } => store_schema(&config),
        Command::Store {
            command: StoreCommand::Copy { from, to },
        } => match store_copy(&from, &to) {
            Ok(code) => return code,
            Err(error) => Err(error),
        },
        Command::Config {
            command: ConfigCommand::Reference,
        } => {
            print!("{}", idemproxy::config::reference::markdown());
            Ok(())
        }
        Command::Records {
            action,
            route,
            key,
            scopes,
            json,
            body,
            resolve,
            config,
        } => {
            let owner = resolve.claim.clone();
            if body && action != RecordsAction::Show {
                eprintln!("idemproxy: --body is for show");
                return ExitCode::FAILURE;
            }
            let call = resolve.verdict(action).map(|verdict| {
                let (verdict, response) = verdict.map_or((None, None), |(verdict, response)| (Some(verdict), response));
                RecordsCall {
                    action,
                    route,
                    query: RecordsQuery {
                        key,
                        scopes,
                        owner,
                        verdict,
                        body,
                    },
                    response,
                }
            });
            match call.and_then(|call| records(&config, &call, json)) {
                Ok(code) => return code,
                Err(error) => Err(error),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemproxy: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr as `format` says, filtered by `RUST_LOG`; with `tracing`, exports
/// the proxy's spans too (whatever `RUST_LOG` says of the log), and hands back the
/// export to shut down at the end.
fn init_logging(format: LogFormat, tracing: Option<&TracingConfig>) -> anyhow::Result<Option<Export>> {
    use tracing_subscriber::filter::{FilterExt, filter_fn};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, fmt};

    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // `server.access_log` is what turns the access log on or off; a `RUST_LOG=warn`
    // meant for the rest should not silence it, unless it names the target itself.
    let named = std::env::var("RUST_LOG").is_ok_and(|directives| directives.contains(idemproxy::ACCESS_LOG));
    if !named && let Ok(directive) = format!("{}=info", idemproxy::ACCESS_LOG).parse() {
        filter = filter.add_directive(directive);
    }
    // The log leaves out the spans that exist for traces only.
    let filter = filter.and(filter_fn(idemproxy::trace::logged));
    let log = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let log = match format {
        LogFormat::Text => log.with_filter(filter).boxed(),
        LogFormat::Json => log.json().with_filter(filter).boxed(),
    };
    let registry = tracing_subscriber::registry().with(log);
    match tracing {
        None => {
            registry.init();
            Ok(None)
        }
        Some(tracing) => {
            let (layer, export) = idemproxy::trace::layer(tracing).context("cannot set up trace export")?;
            registry.with(layer).init();
            Ok(Some(export))
        }
    }
}

fn check(path: &std::path::Path, rate: Option<&str>) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    let rate = rate
        .map(|rate| idemproxy::horizon::Rate::parse(rate).map_err(|error| anyhow::anyhow!("--rate {rate:?}: {error}")))
        .transpose()?;
    print!("{}: ok\n{config}", path.display());
    let mut warnings = config.warnings();
    if let Some(rate) = rate {
        let estimate = idemproxy::horizon::estimate(&config, rate);
        print!("{estimate}");
        warnings.extend(estimate.warnings());
    }
    for warning in warnings {
        eprintln!("idemproxy: warning: {warning}");
    }
    Ok(())
}

fn contract(path: &std::path::Path, format: ContractFormat) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    let out = match format {
        ContractFormat::Json => {
            serde_json::to_string_pretty(&idemproxy::contract::document(&config.routes)).context("cannot write JSON")?
        }
        ContractFormat::Openapi => {
            let version = config.sha256.get(..12).unwrap_or(&config.sha256);
            serde_json::to_string_pretty(&idemproxy::contract::openapi(&config.routes, version))
                .context("cannot write JSON")?
        }
        ContractFormat::Markdown => idemproxy::contract::markdown(&config.routes),
    };
    println!("{}", out.trim_end());
    Ok(())
}

/// Where the conformance cases send their key: `--key-header NAME`, or `--key-from`
/// as a route's `key` writes a source.
fn key_source(key_header: Option<&str>, key_from: &str) -> anyhow::Result<idemproxy::config::KeySource> {
    use idemproxy::config::KeySource;
    if let Some(name) = key_header {
        let name = http::HeaderName::from_bytes(name.as_bytes())
            .with_context(|| format!("--key-header {name:?}: not a field name"))?;
        return Ok(KeySource::Header(name));
    }
    match KeySource::parse(key_from) {
        Ok(KeySource::Body) => anyhow::bail!(
            "--key-from body: a key-less route has no key to send; give header:NAME, json:/pointer, form:NAME or query:NAME"
        ),
        Ok(source) => Ok(source),
        Err(error) => Err(anyhow::anyhow!("--key-from: {error}")),
    }
}

/// Runs the conformance cases and prints them; exit 1 when one failed.
fn conformance(
    url: String,
    path: String,
    slow_path: Option<String>,
    headers: &[String],
    body: Option<String>,
    key_from: idemproxy::config::KeySource,
) -> anyhow::Result<ExitCode> {
    use idemproxy::conformance::{Endpoint, Finding};
    let mut parsed = Vec::with_capacity(headers.len());
    for header in headers {
        let (name, value) = header
            .split_once(':')
            .with_context(|| format!("--header {header:?}: give NAME:VALUE"))?;
        parsed.push((
            http::HeaderName::from_bytes(name.trim().as_bytes())
                .with_context(|| format!("--header {name:?}: not a field name"))?,
            http::HeaderValue::from_str(value.trim())
                .with_context(|| format!("--header {header:?}: not a field value"))?,
        ));
    }
    let endpoint = Endpoint {
        base: url.clone(),
        path,
        slow_path,
        headers: parsed,
        body: body.unwrap_or_else(|| match key_from {
            idemproxy::config::KeySource::Form(_) => String::new(),
            _ => "{}".into(),
        }),
        key_from,
        timeout: std::time::Duration::from_secs(30),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let cases = runtime.block_on(idemproxy::conformance::run(endpoint))?;
    println!("conformance of {url}:");
    for case in &cases {
        println!("  {:<14} {:<20} {}", case.finding.as_str(), case.name, case.saw);
    }
    let failed = cases.iter().filter(|case| case.finding == Finding::Fail).count();
    let unknown = cases.iter().filter(|case| case.finding == Finding::Unknown).count();
    println!(
        "{} passed, {failed} failed, {unknown} could not tell",
        cases.len() - failed - unknown
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs one records call and prints its answer; the exit status says how it went.
fn records(path: &std::path::Path, call: &RecordsCall, json: bool) -> anyhow::Result<ExitCode> {
    let config = Config::load(path)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let reply = runtime.block_on(records::call(&config, call))?;
    if json && !reply.body.is_empty() {
        println!("{}", String::from_utf8_lossy(&reply.body).trim_end());
    }
    match reply.answer {
        Answered::NotFound(error) => {
            eprintln!("idemproxy: {error}");
            return Ok(ExitCode::from(EXIT_NOT_FOUND));
        }
        Answered::Refused(error) => {
            eprintln!("idemproxy: {error}");
            return Ok(ExitCode::from(EXIT_REFUSED));
        }
        Answered::Failed(status, error) => anyhow::bail!("the admin listener answered {status}: {error}"),
        _ if json => {}
        Answered::Shown(view) => print!("{view}"),
        Answered::Purged => println!("purged: the next request with this key runs"),
        Answered::Released(_) => println!("released: the next request with this key runs"),
        Answered::Resolved(resolved) => match resolved.resolved {
            Verdict::Applied => println!(
                "resolved as applied: retries replay the recorded response (operation {})",
                resolved.operation
            ),
            Verdict::NotApplied => println!(
                "resolved as not applied: the next request with this key runs (operation {})",
                resolved.operation
            ),
        },
    }
    Ok(ExitCode::SUCCESS)
}

fn serve(path: &std::path::Path, format: LogFormat) -> anyhow::Result<()> {
    let loaded = Config::load(path);
    let export = init_logging(format, loaded.as_ref().ok().and_then(|config| config.tracing.as_ref()))?;
    let config = loaded?;
    let served = serve_with(path, config);
    if let Some(export) = export {
        export.shutdown();
    }
    served
}

fn serve_with(path: &std::path::Path, config: Config) -> anyhow::Result<()> {
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    // Requests run on the worker threads `start` makes; this runtime only runs the
    // admin listener, the memory store's sweeper and the signal handler.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(async {
        // Installed before the listeners open: SIGHUP's default action ends the process.
        let hangups = hangups()?;
        let running = idemproxy::start(config).await?;
        tokio::spawn(reload_on(hangups, running.reloader(), path.to_path_buf()));
        let stop = running.shutdown_token();
        tokio::spawn(async move {
            shutdown_signal().await;
            tracing::info!("shutting down: draining connections");
            stop.cancel();
        });
        running.stopped().await;
        tracing::info!("stopped");
        Ok(())
    })
}

#[cfg(unix)]
type Hangups = tokio::signal::unix::Signal;
#[cfg(not(unix))]
type Hangups = ();

#[cfg(unix)]
fn hangups() -> anyhow::Result<Hangups> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).context("cannot handle SIGHUP")
}

#[cfg(not(unix))]
fn hangups() -> anyhow::Result<Hangups> {
    Ok(())
}

/// Reloads the config at `path` on each SIGHUP, one at a time, and logs the result.
#[cfg(unix)]
async fn reload_on(mut hangups: Hangups, reloader: Reloader, path: PathBuf) {
    while hangups.recv().await.is_some() {
        match reloader.reload(&path).await {
            Ok(reloaded) => {
                for warning in &reloaded.warnings {
                    tracing::warn!("{warning}");
                }
                tracing::info!(
                    config = %path.display(),
                    sha256 = reloaded.sha256,
                    routes = reloaded.routes,
                    "config reloaded"
                );
            }
            Err(ReloadError::Invalid(error)) => tracing::error!(
                "config reload refused, the old config keeps serving: {:#}",
                anyhow::Error::from(error)
            ),
            Err(error) => tracing::error!(
                config = %path.display(),
                "config reload refused, the old config keeps serving: {:#}",
                anyhow::Error::from(error)
            ),
        }
    }
}

#[cfg(not(unix))]
async fn reload_on(_: Hangups, _: Reloader, _: PathBuf) {}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(_) => return interrupt.await.unwrap_or(()),
        };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    interrupt.await.unwrap_or(());
}
