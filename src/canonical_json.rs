//! The canonical form of a JSON body, for `fingerprint_body = "json"`: two bodies that
//! are the same JSON value, once the `fingerprint_ignore` pointers are left out, have
//! the same canonical form; any other difference shows in it.
//!
//! The rules (RFC 8259 JSON, strictly):
//! - whitespace between tokens is dropped; object members are sorted by their key's
//!   UTF-8 bytes, after escapes are resolved;
//! - strings are compared by the characters they hold: `"\u00e9"` and `"é"` are one
//!   string. They are written back with `"` and `\` escaped, control characters as
//!   `\u00XX`, everything else as UTF-8;
//! - numbers are compared as exact decimals: `1`, `1.0`, `10e-1` and `0.1e1` are one
//!   number, `-0` is `0`, and nothing is rounded: `12345678901234567890123` and
//!   `12345678901234567890124` differ (a float would make them one). A number is
//!   written as its significant digits and a power of ten (`15e-1`);
//! - an ignored object member is removed; an ignored array element is replaced by
//!   `null`, so that the others keep their positions.
//!
//! A body that is not canonical JSON by these rules is fingerprinted as bytes, the way
//! `fingerprint_body = "bytes"` does: invalid JSON, invalid UTF-8, a lone surrogate
//! escape, an object with the same key twice (parsers disagree on which one counts),
//! nesting deeper than [`MAX_DEPTH`], or an exponent beyond 18 digits. The work is
//! linear in the body, plus sorting each object's keys.
//!
//! Hand-written rather than built on serde_json: serde_json keeps the last of two equal
//! keys without saying so, and compares numbers as floats unless its
//! `arbitrary_precision` feature changes every number in the process.

/// How deep arrays and objects may nest before a body is fingerprinted as bytes.
pub const MAX_DEPTH: usize = 128;

/// A parsed `fingerprint_ignore` entry: an RFC 6901 JSON pointer, as its reference
/// tokens with `~1` and `~0` resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPointer(Vec<String>);

impl JsonPointer {
    /// Parses `text`: empty (the whole body) is refused, and so is a pointer that does
    /// not start with `/` or holds a `~` not followed by `0` or `1`.
    pub fn parse(text: &str) -> Result<JsonPointer, String> {
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!("{text:?} is not a JSON pointer: it must start with '/'"));
        };
        let mut tokens = Vec::new();
        for token in rest.split('/') {
            let mut out = String::with_capacity(token.len());
            let mut chars = token.chars();
            while let Some(c) = chars.next() {
                if c != '~' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('0') => out.push('~'),
                    Some('1') => out.push('/'),
                    _ => return Err(format!("{text:?}: '~' must be followed by 0 or 1")),
                }
            }
            tokens.push(out);
        }
        Ok(JsonPointer(tokens))
    }
}

impl std::fmt::Display for JsonPointer {
    /// The pointer as RFC 6901 writes it, `~` and `/` escaped again.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for token in &self.0 {
            write!(f, "/{}", token.replace('~', "~0").replace('/', "~1"))?;
        }
        Ok(())
    }
}

impl JsonPointer {
    /// The reference tokens, unescaped: `/a~1b/c` is `["a/b", "c"]`.
    pub fn tokens(&self) -> &[String] {
        &self.0
    }

    /// Whether `self` points at `other` or into it: `/a/b` is within `/a` and `/a/b`.
    pub fn is_within(&self, other: &JsonPointer) -> bool {
        self.0.starts_with(&other.0)
    }
}

/// The canonical form of `body`, leaving out what `ignore` points at; `None` when the
/// body is not canonical JSON (see the module's rules).
pub fn canonical(body: &[u8], ignore: &[JsonPointer]) -> Option<Vec<u8>> {
    let mut parser = Parser::new(body, 0);
    let pointers: Vec<&[String]> = ignore.iter().map(|pointer| pointer.0.as_slice()).collect();
    let mut out = Vec::with_capacity(body.len());
    parser.value(&mut out, &pointers, &[], 0)?;
    parser.whitespace();
    (parser.at == body.len()).then_some(out)
}

/// A value a pointer found in a body: a string, as the characters it holds, or any
/// other value in its canonical form (`12345` is `12345e0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    String(String),
    Other(Vec<u8>),
}

/// What each of `pointers` finds in `body`: `None` where it finds nothing or `null`.
/// `None` as a whole when the body is not canonical JSON, so that a key is never
/// taken from a body the fingerprint reads as bytes.
pub fn find(body: &[u8], pointers: &[JsonPointer]) -> Option<Vec<Option<Found>>> {
    let mut parser = Parser::new(body, pointers.len());
    let wanted: Vec<(usize, &[String])> = pointers
        .iter()
        .enumerate()
        .map(|(index, pointer)| (index, pointer.0.as_slice()))
        .collect();
    let mut out = Vec::with_capacity(body.len());
    parser.value(&mut out, &[], &wanted, 0)?;
    parser.whitespace();
    if parser.at != body.len() {
        return None;
    }
    let found = parser.found.into_iter().map(|value| {
        let value = value.filter(|value| value != b"null")?;
        if value.first() == Some(&b'"') {
            return Parser::new(&value, 0).string().map(Found::String);
        }
        Some(Found::Other(value))
    });
    Some(found.collect())
}

/// A string in canonical form: quoted, `"` and `\\` and control characters escaped.
pub fn quoted(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 2);
    write_string(&mut out, text);
    out
}

struct Parser<'a> {
    input: &'a [u8],
    at: usize,
    /// The canonical form of each wanted pointer's value, once the parser has met it.
    found: Vec<Option<Vec<u8>>>,
}

impl<'a> Parser<'a> {
    fn new(input: &'a [u8], wanted: usize) -> Parser<'a> {
        Parser {
            input,
            at: 0,
            found: vec![None; wanted],
        }
    }

    /// A value (see `value`), kept for each wanted pointer that ends at it.
    fn wanted_value(
        &mut self,
        out: &mut Vec<u8>,
        ignore: &[&[String]],
        token: &str,
        wanted: &[(usize, &[String])],
        depth: usize,
    ) -> Option<()> {
        let (ends, inner) = descend_wanted(wanted, token);
        let start = out.len();
        self.value(out, ignore, &inner, depth)?;
        for index in ends {
            if let (Some(slot), Some(value)) = (self.found.get_mut(index), out.get(start..)) {
                *slot = Some(value.to_vec());
            }
        }
        Some(())
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// One value, written to `out`. `ignore` holds what is left of the pointers that
    /// lead into this value, and `wanted` what is left of those `find` looks for.
    fn value(
        &mut self,
        out: &mut Vec<u8>,
        ignore: &[&[String]],
        wanted: &[(usize, &[String])],
        depth: usize,
    ) -> Option<()> {
        self.whitespace();
        match self.peek()? {
            b'{' => self.object(out, ignore, wanted, depth + 1),
            b'[' => self.array(out, ignore, wanted, depth + 1),
            b'"' => {
                let text = self.string()?;
                write_string(out, &text);
                Some(())
            }
            b't' => self.literal(out, b"true"),
            b'f' => self.literal(out, b"false"),
            b'n' => self.literal(out, b"null"),
            _ => self.number(out),
        }
    }

    fn literal(&mut self, out: &mut Vec<u8>, word: &[u8]) -> Option<()> {
        let end = self.at.checked_add(word.len())?;
        (self.input.get(self.at..end)? == word).then_some(())?;
        self.at = end;
        out.extend_from_slice(word);
        Some(())
    }

    fn object(
        &mut self,
        out: &mut Vec<u8>,
        ignore: &[&[String]],
        wanted: &[(usize, &[String])],
        depth: usize,
    ) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.expect(b'{')?;
        // Each member with its canonical value, or `None` when a pointer removes it
        // (still kept until the duplicate check).
        let mut members: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        self.whitespace();
        if self.peek()? == b'}' {
            self.at += 1;
        } else {
            loop {
                self.whitespace();
                let key = self.string()?;
                self.whitespace();
                self.expect(b':')?;
                let (dropped, inner) = descend(ignore, &key);
                let mut value = Vec::new();
                self.wanted_value(&mut value, &inner, &key, wanted, depth)?;
                members.push((key, (!dropped).then_some(value)));
                self.whitespace();
                match self.next()? {
                    b',' => continue,
                    b'}' => break,
                    _ => return None,
                }
            }
        }
        members.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        if members.windows(2).any(|pair| matches!(pair, [a, b] if a.0 == b.0)) {
            return None;
        }
        out.push(b'{');
        let mut first = true;
        for (key, value) in members.iter().filter_map(|(key, value)| Some((key, value.as_ref()?))) {
            if !first {
                out.push(b',');
            }
            first = false;
            write_string(out, key);
            out.push(b':');
            out.extend_from_slice(value);
        }
        out.push(b'}');
        Some(())
    }

    fn array(
        &mut self,
        out: &mut Vec<u8>,
        ignore: &[&[String]],
        wanted: &[(usize, &[String])],
        depth: usize,
    ) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.expect(b'[')?;
        out.push(b'[');
        self.whitespace();
        if self.peek()? == b']' {
            self.at += 1;
            out.push(b']');
            return Some(());
        }
        let mut index = 0usize;
        loop {
            if index > 0 {
                out.push(b',');
            }
            let token = index.to_string();
            let (dropped, inner) = descend(ignore, &token);
            if dropped {
                let mut skipped = Vec::new();
                self.value(&mut skipped, &[], &[], depth)?;
                out.extend_from_slice(b"null");
            } else {
                self.wanted_value(out, &inner, &token, wanted, depth)?;
            }
            index += 1;
            self.whitespace();
            match self.next()? {
                b',' => continue,
                b']' => break,
                _ => return None,
            }
        }
        out.push(b']');
        Some(())
    }

    /// A string token, its escapes resolved.
    fn string(&mut self) -> Option<String> {
        self.expect(b'"')?;
        let mut bytes = Vec::new();
        loop {
            // The run up to the next quote, escape or control byte, taken at once.
            let rest = self.input.get(self.at..)?;
            let plain = rest.iter().position(|&byte| needs_escape(byte))?;
            bytes.extend_from_slice(rest.get(..plain)?);
            self.at += plain;
            match self.next()? {
                b'"' => break,
                b'\\' => {
                    let escaped = match self.next()? {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return None,
                    };
                    let mut buffer = [0; 4];
                    bytes.extend_from_slice(escaped.encode_utf8(&mut buffer).as_bytes());
                }
                _ => return None,
            }
        }
        String::from_utf8(bytes).ok()
    }

    /// The character of a `\uXXXX` escape (the `\u` read), a surrogate pair included.
    fn unicode_escape(&mut self) -> Option<char> {
        let high = self.hex4()?;
        if !(0xD800..0xDC00).contains(&high) {
            return char::from_u32(high);
        }
        self.expect(b'\\')?;
        self.expect(b'u')?;
        let low = self.hex4()?;
        if !(0xDC00..0xE000).contains(&low) {
            return None;
        }
        char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
    }

    fn hex4(&mut self) -> Option<u32> {
        let end = self.at.checked_add(4)?;
        let digits = std::str::from_utf8(self.input.get(self.at..end)?).ok()?;
        if !digits.bytes().all(|byte| byte.is_ascii_hexdigit()) {
            return None;
        }
        self.at = end;
        u32::from_str_radix(digits, 16).ok()
    }

    /// A number, written as `[-]DIGITSeEXPONENT` with no leading or trailing zero in
    /// its digits; zero is `0`.
    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let negative = self.peek()? == b'-';
        if negative {
            self.at += 1;
        }
        let integer = self.digits();
        if integer.is_empty() || (integer.len() > 1 && integer.first() == Some(&b'0')) {
            return None;
        }
        let fraction = if self.peek() == Some(b'.') {
            self.at += 1;
            let fraction = self.digits();
            if fraction.is_empty() {
                return None;
            }
            fraction
        } else {
            &[]
        };
        let mut exponent: i64 = 0;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            let sign = match self.peek() {
                Some(b'-') => {
                    self.at += 1;
                    -1
                }
                Some(b'+') => {
                    self.at += 1;
                    1
                }
                _ => 1,
            };
            let digits = self.digits();
            if digits.is_empty() || digits.len() > 18 {
                return None;
            }
            exponent = sign * std::str::from_utf8(digits).ok()?.parse::<i64>().ok()?;
        }
        let significant: Vec<u8> = integer.iter().chain(fraction).copied().collect();
        let leading = significant.iter().take_while(|&&digit| digit == b'0').count();
        let significant = significant.get(leading..)?;
        let trailing = significant.iter().rev().take_while(|&&digit| digit == b'0').count();
        let significant = significant.get(..significant.len() - trailing)?;
        if significant.is_empty() {
            out.push(b'0');
            return Some(());
        }
        let fraction_len = i64::try_from(fraction.len()).ok()?;
        let trailing = i64::try_from(trailing).ok()?;
        let exponent = exponent.checked_sub(fraction_len)?.checked_add(trailing)?;
        if negative {
            out.push(b'-');
        }
        out.extend_from_slice(significant);
        out.push(b'e');
        out.extend_from_slice(exponent.to_string().as_bytes());
        Some(())
    }

    fn digits(&mut self) -> &'a [u8] {
        let input: &'a [u8] = self.input;
        let start = self.at;
        while self.peek().is_some_and(|byte| byte.is_ascii_digit()) {
            self.at += 1;
        }
        input.get(start..self.at).unwrap_or_default()
    }
}

/// The pointers that lead on from `token`: whether one ends here (the value is
/// ignored), and what is left of the others.
fn descend<'a>(ignore: &[&'a [String]], token: &str) -> (bool, Vec<&'a [String]>) {
    let mut dropped = false;
    let mut inner = Vec::new();
    for pointer in ignore {
        if let Some((first, rest)) = pointer.split_first()
            && first == token
        {
            if rest.is_empty() {
                dropped = true;
            } else {
                inner.push(rest);
            }
        }
    }
    (dropped, inner)
}

/// `descend` for the pointers `find` looks for: the indexes of those that end here,
/// and what is left of the others.
fn descend_wanted<'a>(wanted: &[(usize, &'a [String])], token: &str) -> (Vec<usize>, Vec<(usize, &'a [String])>) {
    let mut ends = Vec::new();
    let mut inner = Vec::new();
    for &(index, pointer) in wanted {
        if let Some((first, rest)) = pointer.split_first()
            && first == token
        {
            if rest.is_empty() {
                ends.push(index);
            } else {
                inner.push((index, rest));
            }
        }
    }
    (ends, inner)
}

/// Whether a string's byte is written escaped: a quote, a backslash or a control byte
/// (all ASCII, so never inside a multi-byte character).
fn needs_escape(byte: u8) -> bool {
    byte == b'"' || byte == b'\\' || byte < 0x20
}

fn write_string(out: &mut Vec<u8>, text: &str) {
    out.push(b'"');
    let mut rest = text.as_bytes();
    while let Some(at) = rest.iter().position(|&byte| needs_escape(byte)) {
        let (plain, tail) = rest.split_at(at);
        out.extend_from_slice(plain);
        let Some((&byte, tail)) = tail.split_first() else { break };
        match byte {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            byte => out.extend_from_slice(format!("\\u{byte:04x}").as_bytes()),
        }
        rest = tail;
    }
    out.extend_from_slice(rest);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str, ignore: &[&str]) -> Option<String> {
        let ignore: Vec<JsonPointer> = ignore
            .iter()
            .map(|pointer| JsonPointer::parse(pointer).expect("a pointer"))
            .collect();
        canonical(text.as_bytes(), &ignore).map(|bytes| String::from_utf8(bytes).expect("UTF-8"))
    }

    #[test]
    fn key_order_whitespace_escapes_and_number_spelling_do_not_count() {
        let a = canon(r#"{"b": [1, 2.50, -0], "a": "\u00e9\n"}"#, &[]);
        let b = canon("{\"a\":\"é\\u000a\",\"b\":[1.0,25e-1,0]}", &[]);
        assert_eq!(a, b);
        assert_eq!(a.as_deref(), Some(r#"{"a":"é\u000a","b":[1e0,25e-1,0]}"#));
        assert_eq!(canon("100", &[]), canon("1e2", &[]));
        assert_eq!(canon("0.001", &[]).as_deref(), Some("1e-3"));
        assert_ne!(
            canon("12345678901234567890123", &[]),
            canon("12345678901234567890124", &[])
        );
        assert_eq!(canon(r#""\ud83d\ude00""#, &[]).as_deref(), Some("\"😀\""));
        // Control characters are escaped, a space is not: the form is stored in every
        // record's fingerprint, so it must not change.
        assert_eq!(
            canon(r#"" a\u001f\u007f""#, &[]).as_deref(),
            Some("\" a\\u001f\u{7f}\"")
        );
        // Each short escape is the character it names.
        for (escape, named) in [
            (r#""\"""#, r#""\u0022""#),
            (r#""\\""#, r#""\u005c""#),
            (r#""\/""#, r#""/""#),
            (r#""\b""#, r#""\u0008""#),
            (r#""\f""#, r#""\u000c""#),
            (r#""\n""#, r#""\u000a""#),
            (r#""\r""#, r#""\u000d""#),
            (r#""\t""#, r#""\u0009""#),
        ] {
            let canonical = canon(escape, &[]);
            assert!(canonical.is_some(), "{escape}");
            assert_eq!(canonical, canon(named, &[]), "{escape}");
        }
    }

    #[test]
    fn find_takes_strings_as_they_are_and_other_values_in_canonical_form() {
        let pointers: Vec<JsonPointer> = ["/ref", "/n", "/o", "/list/1", "/none", "/null", "/a~1b"]
            .iter()
            .map(|pointer| JsonPointer::parse(pointer).expect("a pointer"))
            .collect();
        let body = br#"{"ref":"r-1","n":12345,"o":{"b":1.0,"a":true},"list":[1,"x"],"null":null,"a/b":"s"}"#;
        let found = find(body, &pointers).expect("JSON");
        assert_eq!(
            found,
            vec![
                Some(Found::String("r-1".into())),
                Some(Found::Other(b"12345e0".to_vec())),
                Some(Found::Other(br#"{"a":true,"b":1e0}"#.to_vec())),
                Some(Found::String("x".into())),
                None,
                None,
                Some(Found::String("s".into())),
            ]
        );
        // Not canonical JSON: nothing is taken from it.
        assert_eq!(find(br#"{"ref":"a","ref":"b"}"#, &pointers), None);
        assert_eq!(find(b"ref=a", &pointers), None);
        assert!(pointers[3].is_within(&JsonPointer::parse("/list").expect("a pointer")));
        assert!(!pointers[0].is_within(&pointers[1]));
    }

    #[test]
    fn ignored_members_are_removed_and_ignored_elements_become_null() {
        let ignore = ["/meta/request_id", "/items/1", "/a~1b", "/t~0"];
        let a = canon(
            r#"{"meta":{"request_id":"x1","v":1},"items":[1,2,3],"a/b":1,"t~":2}"#,
            &ignore,
        );
        let b = canon(r#"{"meta":{"v":1,"request_id":"y2"},"items":[1,9,3]}"#, &ignore);
        assert_eq!(a, b);
        assert_eq!(a.as_deref(), Some(r#"{"items":[1e0,null,3e0],"meta":{"v":1e0}}"#));
    }

    /// A pointer names one path: a member of the same name anywhere else still counts.
    #[test]
    fn an_ignored_member_is_dropped_at_its_path_only() {
        let ignore = ["/meta/ts"];
        let base = canon(
            r#"{"meta":{"ts":1},"ts":1,"other":{"ts":1},"list":[{"ts":1}]}"#,
            &ignore,
        );
        for changed in [
            r#"{"meta":{"ts":1},"ts":2,"other":{"ts":1},"list":[{"ts":1}]}"#,
            r#"{"meta":{"ts":1},"ts":1,"other":{"ts":2},"list":[{"ts":1}]}"#,
            r#"{"meta":{"ts":1},"ts":1,"other":{"ts":1},"list":[{"ts":2}]}"#,
        ] {
            assert_ne!(canon(changed, &ignore), base, "{changed}");
        }
        let same = canon(
            r#"{"meta":{"ts":9},"ts":1,"other":{"ts":1},"list":[{"ts":1}]}"#,
            &ignore,
        );
        assert_eq!(same, base, "the ignored one itself does not count");
    }

    #[test]
    fn what_is_not_canonical_json_is_refused() {
        for text in [
            "",
            " ",
            "{",
            "[1,]",
            "{\"a\":1,}",
            "01",
            "1.",
            ".5",
            "-",
            "1e",
            "+1",
            "tru",
            "nul",
            "\"\\x\"",
            "\"\\ud800\"",
            "\"\\udc00\"",
            "\"a\u{1}\"",
            "{\"a\":1,\"a\":1}",
            "1 2",
            "\u{feff}1",
            "1e1234567890123456789",
            "NaN",
            "[1}",
            "{1:2}",
        ] {
            assert_eq!(canon(text, &[]), None, "{text:?}");
        }
        assert_eq!(canonical(b"\"\xff\"", &[]), None, "invalid UTF-8");
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert_eq!(canon(&deep, &[]), None);
        let deep_enough = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(canon(&deep_enough, &[]).is_some());
        // An exponent of 18 digits is taken, one of 19 is not.
        assert_eq!(
            canon("1e123456789012345678", &[]).as_deref(),
            Some("1e123456789012345678")
        );
        assert_eq!(canon("1e1234567890123456789", &[]), None);
        // Objects count their depth as arrays do, and the two mix.
        let objects = |depth: usize| format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
        assert!(canon(&objects(MAX_DEPTH), &[]).is_some());
        assert_eq!(canon(&objects(MAX_DEPTH + 1), &[]), None);
        let mixed = format!("[{}]", objects(MAX_DEPTH - 1));
        assert!(canon(&mixed, &[]).is_some());
        assert_eq!(canon(&format!("[{mixed}]"), &[]), None);
        // A duplicate is refused even where the pointer drops it.
        assert_eq!(canon("{\"a\":1,\"a\":2}", &["/a"]), None);
    }

    #[test]
    fn pointers_are_parsed_per_rfc_6901() {
        assert_eq!(
            JsonPointer::parse("/a~1b/~0c/0").expect("valid"),
            JsonPointer(vec!["a/b".into(), "~c".into(), "0".into()])
        );
        assert_eq!(
            JsonPointer::parse("/").expect("valid"),
            JsonPointer(vec![String::new()])
        );
        // Written back as RFC 6901 spells it (the contract document lists them so).
        for text in ["/a~1b/~0c/0", "/", "/meta/ts", "//x"] {
            assert_eq!(JsonPointer::parse(text).expect("valid").to_string(), text);
        }
        for bad in ["", "a", "/a~2", "/a~"] {
            assert!(JsonPointer::parse(bad).is_err(), "{bad:?}");
        }
    }
}
