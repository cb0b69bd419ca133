//! The operator's side of the records API: `idemproxy records show|purge|release`
//! calls the admin listener named in the config, with the token from its
//! `token_file`, and returns the answer for the CLI to print.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::{Context, bail};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::config::Config;

/// One records call: what to do, to which record.
#[derive(Debug, Clone)]
pub struct RecordsCall {
    /// `show`, `purge` or `release`.
    pub action: RecordsAction,
    pub route: String,
    pub key: String,
    /// `NAME:VALUE`, as the route's scope would have produced them.
    pub scopes: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordsAction {
    Show,
    Purge,
    Release,
}

/// What the admin listener answered: its status, and its JSON body (null for 204).
#[derive(Debug, Clone)]
pub struct RecordsAnswer {
    pub status: StatusCode,
    pub body: Value,
}

/// How long the CLI waits for the admin listener.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Makes `call` against the admin listener `config` names.
pub async fn records(config: &Config, call: &RecordsCall) -> anyhow::Result<RecordsAnswer> {
    let Some(admin) = &config.admin else {
        bail!("the config has no [admin] section: the records API is off");
    };
    let Some(token) = &admin.token else {
        bail!("the config's [admin] has no token_file: the records API is off");
    };
    let token = std::fs::read_to_string(&token.file)
        .with_context(|| format!("cannot read the admin token from {}", token.file.display()))?;
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("key", &call.key);
    for scope in &call.scopes {
        query.append_pair("scope", scope);
    }
    let route: String = form_urlencoded::byte_serialize(call.route.as_bytes()).collect();
    let (method, path) = match call.action {
        RecordsAction::Show => (Method::GET, format!("/records/{route}")),
        RecordsAction::Purge => (Method::DELETE, format!("/records/{route}")),
        RecordsAction::Release => (Method::POST, format!("/records/{route}/release")),
    };
    let addr = reachable(admin.listen);
    let request = Request::builder()
        .method(method)
        .uri(format!("{path}?{}", query.finish()))
        .header(http::header::HOST, addr.to_string())
        .header(http::header::AUTHORIZATION, format!("Bearer {}", token.trim()))
        .body(Full::new(bytes::Bytes::new()))
        .context("cannot build the request")?;
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("cannot connect to the admin listener at {addr}"))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("the admin listener did not speak HTTP/1.1")?;
        tokio::spawn(connection);
        let response = sender
            .send_request(request)
            .await
            .context("the admin listener did not answer")?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .context("the admin listener's answer broke off")?
            .to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
        };
        anyhow::Ok(RecordsAnswer { status, body })
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .with_context(|| format!("the admin listener at {addr} did not answer within {TIMEOUT:?}"))?
}

/// The admin listener's address as a client reaches it: a wildcard is this host.
fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), listen.port()),
        _ => listen,
    }
}
