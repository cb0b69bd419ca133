//! The idemproxy binary: parses the command line, sets up logging, and hands over to
//! the library. Start-up and config errors exit non-zero with one clear line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use idemproxy::Config;
use tracing_subscriber::EnvFilter;

/// mimalloc: fewer cycles per request than the system allocator on this workload
/// (see the bench figures in the README).
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
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match cli.command {
        Command::Check { config } => check(&config),
        Command::Serve { config } => serve(&config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemproxy: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn check(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    print!("{}: ok\n{config}", path.display());
    for warning in config.warnings() {
        eprintln!("idemproxy: warning: {warning}");
    }
    Ok(())
}

fn serve(path: &std::path::Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
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
        let running = idemproxy::start(config).await?;
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
