//! The request target as the guard and the upstream both see it: one canonical path
//! and one validated authority. A differently spelled path (`/v1/./pay`, `//v1/pay`,
//! `/v1/%70ay`) or a second `Host` must never let a request past the guard that the
//! upstream then reads as the guarded one, so the proxy routes, fingerprints and
//! forwards the same canonical request. Pure: no I/O here.
//!
//! The path, as RFC 3986 §6.2.2 normalises a URI and as nginx and Envoy do before
//! they match a location or a route:
//! - percent-encodings of unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded,
//!   and every other encoding is written with upper-case hex (`%2f` is `%2F`); a `%`
//!   not followed by two hex digits is refused;
//! - dot segments are removed (§5.2.4), encoded ones included (`%2e%2e` is `..`); a
//!   `..` above the root stays at the root;
//! - runs of slashes are merged into one (`merge_slashes`, as nginx's);
//! - an encoded slash or backslash (`%2F`, `%5C`) or a raw backslash, and a `;` path
//!   parameter, are refused unless the server keeps them (`escaped_slashes`,
//!   `path_parameters`): whether `/a%2Fb` is one segment or two, and whether `;x` is
//!   part of a segment, depends on the upstream, which the proxy cannot know.
//!
//! The authority: one `Host` (RFC 9112 §3.2: none on HTTP/1.1, two, or an invalid one
//! is a 400), an absolute-form target's own authority over `Host` (§3.2.2), and on
//! HTTP/2 a `host` that disagrees with `:authority` refused. Only a validated
//! authority is ever forwarded in `X-Forwarded-Host`.

use std::borrow::Cow;

use http::{HeaderMap, HeaderValue, Uri, Version, header};
use serde::Deserialize;

/// `server.escaped_slashes` and `server.path_parameters`: what the proxy does with a
/// spelling whose meaning depends on the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Spelling {
    /// 400 `invalid-path`: nothing is forwarded.
    Reject,
    /// Forwarded as sent (`%2F` with upper-case hex).
    Keep,
}

/// How request paths are made canonical (`[server]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathPolicy {
    pub merge_slashes: bool,
    pub escaped_slashes: Spelling,
    pub path_parameters: Spelling,
}

impl Default for PathPolicy {
    fn default() -> PathPolicy {
        PathPolicy {
            merge_slashes: true,
            escaped_slashes: Spelling::Reject,
            path_parameters: Spelling::Reject,
        }
    }
}

impl std::fmt::Display for PathPolicy {
    /// The policy as `idemproxy check` prints it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verdict = |spelling| match spelling {
            Spelling::Reject => "refused (400)",
            Spelling::Keep => "kept",
        };
        write!(
            f,
            "dot segments removed, unreserved escapes decoded, slashes {}; %2F and %5C {}; ';' parameters {}",
            if self.merge_slashes { "merged" } else { "kept" },
            verdict(self.escaped_slashes),
            verdict(self.path_parameters),
        )
    }
}

/// Why a request target is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestTargetError {
    #[error("the path holds a '%' that is not followed by two hex digits")]
    MalformedEscape,
    /// Escapes that decode to bytes that are not UTF-8 (an overlong `%C0%AE` for `.`,
    /// `%C0%AF` for `/`): what an upstream that decodes leniently makes of them is its
    /// own guess.
    #[error("the path's escapes do not decode to UTF-8")]
    InvalidUtf8,
    #[error("the path holds an encoded slash or a backslash (%2F, %5C, \\)")]
    EscapedSlash,
    #[error("the path holds a ';' parameter")]
    Parameter,
    #[error("the path differs from a guarded route's only in letter case")]
    CaseVariant,
    #[error("the method differs from a guarded one only in letter case")]
    MethodCase,
    #[error("the request has no Host")]
    MissingHost,
    #[error("the request has more than one Host")]
    RepeatedHost,
    #[error("the request's Host is not a valid host and port")]
    InvalidHost,
    #[error("the request's host and :authority disagree")]
    ConflictingHost,
}

/// The canonical form of `path` under `policy`: borrowed when `path` is canonical
/// already (the common case, found in one pass), else rebuilt.
pub fn canonical_path<'a>(path: &'a str, policy: &PathPolicy) -> Result<Cow<'a, str>, RequestTargetError> {
    if !path.starts_with('/') {
        // `*` (OPTIONS) or an authority-form target: nothing to normalise.
        return Ok(Cow::Borrowed(path));
    }
    if is_canonical(path, policy) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode(path, policy)?;
    Ok(Cow::Owned(remove_dot_segments(&decoded, policy.merge_slashes)))
}

/// Whether `path` needs no work: no escape, no backslash, no parameter, no dot
/// segment and (when merging) no run of slashes.
fn is_canonical(path: &str, policy: &PathPolicy) -> bool {
    let bytes = path.as_bytes();
    for (at, byte) in bytes.iter().enumerate() {
        match byte {
            b'%' | b'\\' | b';' => return false,
            b'/' => {
                let rest = &bytes[at + 1..];
                if policy.merge_slashes && rest.first() == Some(&b'/') {
                    return false;
                }
                let segment = rest.split(|byte| *byte == b'/').next().unwrap_or_default();
                if segment == b"." || segment == b".." {
                    return false;
                }
            }
            _ => {}
        }
    }
    true
}

fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

/// `path` with unreserved escapes decoded and the others in upper-case hex; refuses
/// what the policy refuses.
fn decode(path: &str, policy: &PathPolicy) -> Result<String, RequestTargetError> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    // The path with every escape decoded: it must be UTF-8.
    let mut decoded = Vec::with_capacity(path.len());
    let mut at = 0;
    while at < bytes.len() {
        let byte = bytes[at];
        match byte {
            b'%' => {
                let hex = bytes.get(at + 1..at + 3).ok_or(RequestTargetError::MalformedEscape)?;
                let value = std::str::from_utf8(hex)
                    .ok()
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                    .filter(|_| hex.iter().all(u8::is_ascii_hexdigit))
                    .ok_or(RequestTargetError::MalformedEscape)?;
                decoded.push(value);
                if is_unreserved(value) {
                    out.push(char::from(value));
                } else {
                    if matches!(value, b'/' | b'\\') && policy.escaped_slashes == Spelling::Reject {
                        return Err(RequestTargetError::EscapedSlash);
                    }
                    out.push('%');
                    out.push_str(&format!("{value:02X}"));
                }
                at += 3;
                continue;
            }
            b'\\' if policy.escaped_slashes == Spelling::Reject => return Err(RequestTargetError::EscapedSlash),
            b';' if policy.path_parameters == Spelling::Reject => return Err(RequestTargetError::Parameter),
            _ => out.push(char::from(byte)),
        }
        decoded.push(byte);
        at += 1;
    }
    if std::str::from_utf8(&decoded).is_err() {
        return Err(RequestTargetError::InvalidUtf8);
    }
    Ok(out)
}

/// RFC 3986 §5.2.4 on an absolute path, with runs of slashes merged when `merge`.
fn remove_dot_segments(path: &str, merge: bool) -> String {
    let segments: Vec<&str> = path.get(1..).unwrap_or_default().split('/').collect();
    let last = segments.len().saturating_sub(1);
    let mut kept: Vec<&str> = Vec::with_capacity(segments.len());
    let mut trailing_slash = false;
    for (index, segment) in segments.into_iter().enumerate() {
        let is_last = index == last;
        match segment {
            "." => trailing_slash = is_last,
            ".." => {
                kept.pop();
                trailing_slash = is_last;
            }
            "" if is_last => trailing_slash = true,
            "" if merge => {}
            segment => {
                kept.push(segment);
                trailing_slash = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    for segment in &kept {
        out.push('/');
        out.push_str(segment);
    }
    if trailing_slash || kept.is_empty() {
        out.push('/');
    }
    out
}

/// The authority a request names, validated: the absolute-form target's or
/// `:authority` (HTTP/2), else the one `Host`. `None` only where the protocol allows
/// none (HTTP/1.0, and HTTP/2 without `:authority`).
pub fn authority(version: Version, uri: &Uri, headers: &HeaderMap) -> Result<Option<HeaderValue>, RequestTargetError> {
    let mut hosts = headers.get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(RequestTargetError::RepeatedHost);
    }
    if let Some(host) = host
        && !valid_authority(host.as_bytes())
    {
        return Err(RequestTargetError::InvalidHost);
    }
    let Some(target) = uri.authority() else {
        return match host {
            None if version == Version::HTTP_11 => Err(RequestTargetError::MissingHost),
            host => Ok(host.cloned()),
        };
    };
    if !valid_authority(target.as_str().as_bytes()) {
        return Err(RequestTargetError::InvalidHost);
    }
    // On HTTP/2 both name the target, and must agree; on HTTP/1.1 the absolute-form
    // target's authority wins and `Host` is ignored (RFC 9112 §3.2.2).
    if version == Version::HTTP_2
        && host.is_some_and(|host| !host.as_bytes().eq_ignore_ascii_case(target.as_str().as_bytes()))
    {
        return Err(RequestTargetError::ConflictingHost);
    }
    HeaderValue::from_str(target.as_str())
        .map(Some)
        .map_err(|_| RequestTargetError::InvalidHost)
}

/// Whether `value` is `host[:port]`: a DNS name or IPv4 address (letters, digits,
/// `-`, `.`, `_`, `~`), or an IPv6 literal in brackets; a port of 1 to 5 digits. No
/// user information, path, list or space.
fn valid_authority(value: &[u8]) -> bool {
    // The host is checked in each arm (never empty); what follows it is the port.
    let port = match value.strip_prefix(b"[") {
        Some(rest) => {
            let Some(end) = rest.iter().position(|byte| *byte == b']') else {
                return false;
            };
            let literal = &rest[..end];
            if literal.is_empty()
                || !literal
                    .iter()
                    .all(|b| b.is_ascii_hexdigit() || matches!(b, b':' | b'.'))
            {
                return false;
            }
            &rest[end + 1..]
        }
        None => {
            let colon = value.iter().position(|byte| *byte == b':').unwrap_or(value.len());
            let host = &value[..colon];
            if host.is_empty() || !host.iter().all(|byte| is_unreserved(*byte)) {
                return false;
            }
            &value[colon..]
        }
    };
    match port.strip_prefix(b":") {
        None => port.is_empty(),
        Some(digits) => (1..=5).contains(&digits.len()) && digits.iter().all(u8::is_ascii_digit),
    }
}

/// The host part of a validated authority, as routes match it: without its port and
/// brackets, without one trailing dot (`pay.example.` is `pay.example`).
pub fn host_of(authority: &str) -> &str {
    let host = match authority.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => authority.rsplit_once(':').map_or(authority, |(host, _)| host),
    };
    host.strip_suffix('.').unwrap_or(host)
}

/// `uri` in origin form with `path` in place of its own: what the proxy forwards.
pub fn with_path(uri: &Uri, path: &str) -> Result<Uri, http::Error> {
    let path_and_query = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_string(),
    };
    Uri::builder().path_and_query(path_and_query).build()
}

#[cfg(test)]
mod tests;
