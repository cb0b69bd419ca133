//! Raw HTTP/2 frames, for clients that misbehave on purpose (floods of resets, of
//! CONTINUATION frames, of streams): what a client library refuses to send.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

pub const DATA: u8 = 0;
pub const HEADERS: u8 = 1;
pub const RST_STREAM: u8 = 3;
pub const SETTINGS: u8 = 4;
pub const GOAWAY: u8 = 7;
pub const CONTINUATION: u8 = 9;

pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;

/// RST_STREAM and GOAWAY error codes.
pub const CANCEL: u32 = 0x8;
pub const REFUSED_STREAM: u32 = 0x7;

/// One frame: a 24-bit length, type, flags, a 31-bit stream id, the payload.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = u32::try_from(payload.len()).expect("a frame payload under 16 MiB");
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&length.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// An HPACK integer with an `prefix`-bit prefix (RFC 7541 §5.1) and `first` as the
/// bits above it.
fn integer(out: &mut Vec<u8>, value: usize, prefix: u8, first: u8) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(first | u8::try_from(value).expect("fits the prefix"));
        return;
    }
    out.push(first | u8::try_from(max).expect("fits"));
    let mut rest = value - max;
    while rest >= 128 {
        out.push(u8::try_from(rest % 128).expect("a byte") | 0x80);
        rest /= 128;
    }
    out.push(u8::try_from(rest).expect("a byte"));
}

/// A header field as an HPACK literal without indexing, with a new name, no Huffman.
pub fn literal(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0x00);
    integer(out, name.len(), 7, 0);
    out.extend_from_slice(name.as_bytes());
    integer(out, value.len(), 7, 0);
    out.extend_from_slice(value.as_bytes());
}

/// The header block of a request.
pub fn request(method: &str, path: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    request_for(method, path, Some("localhost"), extra)
}

/// The header block of a request with `authority` as its `:authority`, or none (a
/// client may leave it out, RFC 9113 §8.3.1).
pub fn request_for(method: &str, path: &str, authority: Option<&str>, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in [(":method", method), (":scheme", "http"), (":path", path)] {
        literal(&mut block, name, value);
    }
    if let Some(authority) = authority {
        literal(&mut block, ":authority", authority);
    }
    for (name, value) in extra {
        literal(&mut block, name, value);
    }
    block
}

/// A frame the server sent: its type, flags, stream and payload.
#[derive(Debug, Clone)]
pub struct Received {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Received {
    /// The error code of a RST_STREAM or GOAWAY.
    pub fn error_code(&self) -> Option<u32> {
        let at = match self.kind {
            RST_STREAM => 0,
            GOAWAY => 4,
            _ => return None,
        };
        let bytes: [u8; 4] = self.payload.get(at..at + 4)?.try_into().ok()?;
        Some(u32::from_be_bytes(bytes))
    }
}

/// A raw HTTP/2 connection: frames go out as written, and frames coming back arrive on
/// `frames` (which ends when the server closes the connection).
pub struct Connection {
    pub writer: OwnedWriteHalf,
    pub frames: mpsc::UnboundedReceiver<Received>,
}

impl Connection {
    /// Connects, sends the preface and an empty SETTINGS frame.
    pub async fn open(addr: std::net::SocketAddr) -> Connection {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (reader, mut writer) = stream.into_split();
        writer.write_all(PREFACE).await.expect("preface");
        writer.write_all(&frame(SETTINGS, 0, 0, &[])).await.expect("settings");
        let (sender, frames) = mpsc::unbounded_channel();
        tokio::spawn(read_frames(reader, sender));
        Connection { writer, frames }
    }

    /// Waits for the next frame for up to `limit`; `None` when the connection is
    /// closed or nothing came.
    pub async fn next(&mut self, limit: Duration) -> Option<Received> {
        tokio::time::timeout(limit, self.frames.recv()).await.ok().flatten()
    }
}

async fn read_frames(mut reader: OwnedReadHalf, frames: mpsc::UnboundedSender<Received>) {
    let mut head = [0u8; 9];
    loop {
        if reader.read_exact(&mut head).await.is_err() {
            return;
        }
        let length = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; length];
        if reader.read_exact(&mut payload).await.is_err() {
            return;
        }
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let received = Received {
            kind: head[3],
            flags: head[4],
            stream,
            payload,
        };
        if frames.send(received).is_err() {
            return;
        }
    }
}

/// The resident set of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("read the process status")
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:")?.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// User and system CPU time of process `pid`, in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read the process stat");
    // Fields after the command name, which is in parentheses and may hold spaces.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after ')'.
    fields.get(11).and_then(|utime| utime.parse::<u64>().ok()).unwrap_or(0)
        + fields.get(12).and_then(|stime| stime.parse::<u64>().ok()).unwrap_or(0)
}
