//! `route.idempotency.key`: where a guarded request's key is found (docs/design.md §23).
//! Each source is written as the config spells it, `kind:name`; the first source a
//! request carries gives its key.

use std::fmt;

use http::header::HeaderName;

use crate::canonical_json::JsonPointer;

/// One place a request's idempotency key may be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `header:NAME`: a header field, parsed as the `Idempotency-Key` header is.
    Header(HeaderName),
    /// `json:/pointer`, or `json:/a&/b` for one key made of several values (all must
    /// be present): values in the JSON body.
    Json(Vec<JsonPointer>),
    /// `form:NAME`: a field of an `application/x-www-form-urlencoded` body.
    Form(String),
    /// `query:NAME`: a parameter of the query string.
    Query(String),
    /// `body`: no key at all; the request itself (method, canonical path and query,
    /// fingerprinted headers and body as the fingerprint reads it, within its scope) is the key, kept for the
    /// route's `dedup_window`.
    Body,
}

impl KeySource {
    /// Parses one source as the config writes it.
    pub fn parse(text: &str) -> Result<KeySource, String> {
        if text == "body" {
            return Ok(KeySource::Body);
        }
        let Some((kind, name)) = text.split_once(':') else {
            return Err(format!(
                "{text:?} is not a key source: write header:NAME, json:/pointer, form:NAME, query:NAME or body"
            ));
        };
        if name.is_empty() {
            return Err(format!("{text:?} names no {kind} (write {kind}:NAME)"));
        }
        match kind {
            "header" => HeaderName::from_bytes(name.as_bytes())
                .map(KeySource::Header)
                .map_err(|_| format!("{text:?}: {name:?} is not a header name")),
            "json" => {
                let pointers = name
                    .split('&')
                    .map(JsonPointer::parse)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| format!("{text:?}: {error}"))?;
                Ok(KeySource::Json(pointers))
            }
            "form" | "query" if name.bytes().any(|byte| !byte.is_ascii_graphic()) => {
                Err(format!("{text:?}: a field name is visible ASCII"))
            }
            "form" => Ok(KeySource::Form(name.to_string())),
            "query" => Ok(KeySource::Query(name.to_string())),
            other => Err(format!(
                "{text:?}: {other:?} is not a kind of key source (header, json, form, query or body)"
            )),
        }
    }

    /// Whether the body must be read before this source can be looked at.
    pub fn needs_body(&self) -> bool {
        matches!(self, KeySource::Json(_) | KeySource::Form(_) | KeySource::Body)
    }
}

impl fmt::Display for KeySource {
    /// The source as the config spells it: what a 400 and `check` name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(name) => write!(f, "header:{name}"),
            KeySource::Json(pointers) => {
                f.write_str("json:")?;
                for (index, pointer) in pointers.iter().enumerate() {
                    if index > 0 {
                        f.write_str("&")?;
                    }
                    write!(f, "{pointer}")?;
                }
                Ok(())
            }
            KeySource::Form(name) => write!(f, "form:{name}"),
            KeySource::Query(name) => write!(f, "query:{name}"),
            KeySource::Body => f.write_str("body"),
        }
    }
}

/// The sources, as a 400 and `check` list them: `header:Idempotency-Key, json:/ref`.
pub fn describe(sources: &[KeySource]) -> String {
    sources.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}
