//! RESP2 and RESP3 as Redis speaks them: request parsing (multibulk and inline commands) and
//! reply encoding.
//!
//! Requests are the same in both protocols. Replies are built once as a [`Reply`] tree and
//! encoded for the connection's protocol: RESP3 types that RESP2 lacks are written as Redis 7
//! writes them to a RESP2 client (a map as a flat array of key/value pairs, a double as a bulk
//! string, a verbatim string as a bulk string, every null as `$-1` or `*-1`).
//!
//! The parser is incremental: [`Parser::next`] consumes complete frames from the front of a
//! connection's input buffer and keeps a partly received multibulk (count read, some
//! arguments read) in its own state, so a command arriving in many small reads is parsed in
//! linear time. Limits (bulk length, argument count, inline line length) are checked when a
//! header is read, before any payload is buffered. As Redis 7, a connection that must still
//! authenticate may send at most 10 arguments of at most 16 KiB each (`Protocol error:
//! unauthenticated multibulk length` / `bulk length`), so an unauthenticated client cannot
//! make the server buffer large requests; and no command may exceed the query-buffer limit
//! (1 GiB by default, Redis's `client-query-buffer-limit`) in total, whatever its argument
//! count and sizes. Protocol errors carry Redis's own messages
//! (`Protocol error: invalid bulk length`, ...); the connection replies `-ERR <message>` and
//! closes, as Redis does.

use bytes::{Buf, Bytes, BytesMut};

/// A command: its name and arguments, binary-safe.
pub type Command = Vec<Bytes>;

/// Request size limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest bulk string (one argument). Default 64 MiB: tierkv's own value limit, so a
    /// longer argument could never be stored (Redis allows 512 MiB; settable up to that).
    pub max_bulk_len: usize,
    /// Most arguments in one multibulk command. Default 1,048,576.
    pub max_multibulk_len: usize,
    /// Longest inline command line, and longest multibulk/bulk header. Default 64 KiB, as
    /// Redis (`PROTO_INLINE_MAX_SIZE`).
    pub max_inline_len: usize,
    /// Most bytes of arguments in one command (and of the commands one MULTI queues).
    /// Default 1 GiB, as Redis's `client-query-buffer-limit`.
    pub max_query_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_bulk_len: 64 << 20, max_multibulk_len: 1 << 20, max_inline_len: 64 << 10, max_query_len: 1 << 30 }
    }
}

/// Most arguments of a command from a connection that has not authenticated (Redis 7).
pub const UNAUTHENTICATED_MULTIBULK_LEN: usize = 10;
/// Longest argument of a command from a connection that has not authenticated (Redis 7).
pub const UNAUTHENTICATED_BULK_LEN: usize = 16 << 10;

/// A protocol error: the message Redis sends after `-ERR ` before closing the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtoError(pub String);

impl ProtoError {
    fn new(s: &str) -> ProtoError {
        ProtoError(format!("Protocol error: {s}"))
    }
}

/// Incremental request parser (one per connection).
#[derive(Debug, Default)]
pub struct Parser {
    /// Arguments still expected by the multibulk being read.
    remaining: usize,
    /// Length of the bulk whose header was read.
    bulk: Option<usize>,
    args: Command,
    in_multibulk: bool,
    /// Bytes of `args` so far.
    held: usize,
    /// The connection has not authenticated yet (see [`Parser::set_authenticated`]).
    unauthenticated: bool,
}

/// Parse a Redis integer header (`string2ll`: optional `-`, digits, no leading `+`, no spaces).
fn parse_len(b: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(b).ok()?;
    if s.is_empty() || s.starts_with('+') || (s.len() > 1 && s.starts_with('0')) || s.starts_with("-0") {
        return None;
    }
    s.parse::<i64>().ok()
}

fn find_crlf(buf: &[u8]) -> Option<usize> {
    buf.iter().position(|&b| b == b'\r')
}

impl Parser {
    /// A new parser.
    pub fn new() -> Parser {
        Parser::default()
    }

    /// Whether the connection has authenticated: until it has, commands are held to
    /// [`UNAUTHENTICATED_MULTIBULK_LEN`] arguments of [`UNAUTHENTICATED_BULK_LEN`] bytes.
    pub fn set_authenticated(&mut self, authed: bool) {
        self.unauthenticated = !authed;
    }

    /// Take the next complete command from the front of `buf`. `Ok(None)`: more input is
    /// needed (everything usable so far has been consumed into the parser's state). Empty
    /// commands (an empty inline line, `*0`) are skipped.
    pub fn next(&mut self, buf: &mut BytesMut, lim: &Limits) -> Result<Option<Command>, ProtoError> {
        loop {
            if !self.in_multibulk {
                if buf.is_empty() {
                    return Ok(None);
                }
                if buf[0] != b'*' {
                    match self.inline(buf, lim)? {
                        Some(cmd) if cmd.is_empty() => continue,
                        other => return Ok(other),
                    }
                }
                let Some(cr) = find_crlf(buf) else {
                    if buf.len() > lim.max_inline_len {
                        return Err(ProtoError::new("too big mbulk count string"));
                    }
                    return Ok(None);
                };
                if cr + 1 >= buf.len() {
                    return Ok(None);
                }
                let n = parse_len(&buf[1..cr]);
                match n {
                    Some(n) if self.unauthenticated && n > UNAUTHENTICATED_MULTIBULK_LEN as i64 => {
                        return Err(ProtoError::new("unauthenticated multibulk length"))
                    }
                    Some(n) if n > lim.max_multibulk_len as i64 => {
                        return Err(ProtoError::new("invalid multibulk length"))
                    }
                    Some(n) => {
                        buf.advance(cr + 2);
                        if n <= 0 {
                            continue;
                        }
                        self.in_multibulk = true;
                        self.held = 0;
                        self.remaining = n as usize;
                        self.args = Vec::with_capacity(self.remaining.min(1024));
                    }
                    None => return Err(ProtoError::new("invalid multibulk length")),
                }
            }
            while self.remaining > 0 {
                let len = match self.bulk {
                    Some(len) => len,
                    None => {
                        if buf.is_empty() {
                            return Ok(None);
                        }
                        if buf[0] != b'$' {
                            let got = buf[0] as char;
                            return Err(ProtoError(format!("Protocol error: expected '$', got '{got}'")));
                        }
                        let Some(cr) = find_crlf(buf) else {
                            if buf.len() > lim.max_inline_len {
                                return Err(ProtoError::new("too big bulk count string"));
                            }
                            return Ok(None);
                        };
                        if cr + 1 >= buf.len() {
                            return Ok(None);
                        }
                        let len = match parse_len(&buf[1..cr]) {
                            Some(l) if self.unauthenticated && l > UNAUTHENTICATED_BULK_LEN as i64 => {
                                return Err(ProtoError::new("unauthenticated bulk length"))
                            }
                            Some(l) if l >= 0 && l as u64 <= lim.max_bulk_len as u64 => l as usize,
                            _ => return Err(ProtoError::new("invalid bulk length")),
                        };
                        if self.held.saturating_add(len) > lim.max_query_len {
                            return Err(ProtoError::new("command larger than the query buffer limit"));
                        }
                        buf.advance(cr + 2);
                        self.bulk = Some(len);
                        len
                    }
                };
                if buf.len() < len + 2 {
                    // No reservation of `len` up front: memory follows the bytes that
                    // actually arrive, so a huge length header costs nothing by itself.
                    return Ok(None);
                }
                let arg = buf.split_to(len).freeze();
                buf.advance(2); // the CRLF after the payload (not checked, as Redis)
                self.held += len;
                self.args.push(arg);
                self.bulk = None;
                self.remaining -= 1;
            }
            self.in_multibulk = false;
            return Ok(Some(std::mem::take(&mut self.args)));
        }
    }

    fn inline(&mut self, buf: &mut BytesMut, lim: &Limits) -> Result<Option<Command>, ProtoError> {
        let Some(nl) = buf.iter().position(|&b| b == b'\n') else {
            if buf.len() > lim.max_inline_len {
                return Err(ProtoError::new("too big inline request"));
            }
            return Ok(None);
        };
        if nl > lim.max_inline_len {
            return Err(ProtoError::new("too big inline request"));
        }
        let line = buf.split_to(nl + 1);
        let mut line = &line[..nl];
        if line.last() == Some(&b'\r') {
            line = &line[..line.len() - 1];
        }
        let args = split_args(line).ok_or_else(|| ProtoError::new("unbalanced quotes in request"))?;
        if args.len() > lim.max_multibulk_len {
            return Err(ProtoError::new("invalid multibulk length"));
        }
        Ok(Some(args.into_iter().map(Bytes::from).collect()))
    }
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Split an inline command line as Redis's `sdssplitargs`: whitespace separates arguments;
/// `"..."` takes `\n \r \t \b \a \\ \" \xHH` escapes; `'...'` takes `\'`; a closing quote
/// must be followed by whitespace or the end. `None` on unbalanced quotes.
pub fn split_args(line: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    let mut i = 0;
    let n = line.len();
    loop {
        while i < n && line[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= n {
            return Some(out);
        }
        let mut cur = Vec::new();
        let (mut inq, mut insq) = (false, false);
        loop {
            if inq {
                if i >= n {
                    return None;
                }
                if line[i] == b'\\' && i + 3 < n && line[i + 1] == b'x' {
                    if let (Some(h), Some(l)) = (hex(line[i + 2]), hex(line[i + 3])) {
                        cur.push(h * 16 + l);
                        i += 4;
                        continue;
                    }
                }
                if line[i] == b'\\' && i + 1 < n {
                    i += 1;
                    cur.push(match line[i] {
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'b' => 8,
                        b'a' => 7,
                        c => c,
                    });
                } else if line[i] == b'"' {
                    if i + 1 < n && !line[i + 1].is_ascii_whitespace() {
                        return None;
                    }
                    i += 1;
                    break;
                } else {
                    cur.push(line[i]);
                }
                i += 1;
            } else if insq {
                if i >= n {
                    return None;
                }
                if line[i] == b'\\' && i + 1 < n && line[i + 1] == b'\'' {
                    cur.push(b'\'');
                    i += 2;
                    continue;
                } else if line[i] == b'\'' {
                    if i + 1 < n && !line[i + 1].is_ascii_whitespace() {
                        return None;
                    }
                    i += 1;
                    break;
                }
                cur.push(line[i]);
                i += 1;
            } else {
                if i >= n || line[i].is_ascii_whitespace() {
                    break;
                }
                match line[i] {
                    b'"' => inq = true,
                    b'\'' => insq = true,
                    c => cur.push(c),
                }
                i += 1;
            }
        }
        out.push(cur);
    }
}

/// A reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `+OK`.
    Ok,
    /// A status line (`+...`).
    Status(String),
    /// An error line (`-...`): the text includes its code (`ERR ...`, `WRONGTYPE ...`).
    Error(String),
    /// `:n`.
    Int(i64),
    /// `$len` + bytes.
    Bulk(Vec<u8>),
    /// `$-1`.
    Nil,
    /// `*n` + elements.
    Array(Vec<Reply>),
    /// A null array: `*-1` in RESP2 (EXEC aborted by WATCH), `_` in RESP3.
    NilArray,
    /// RESP3 map (`%n`); a flat array of 2n elements in RESP2.
    Map(Vec<(Reply, Reply)>),
    /// RESP3 double (`,`); a bulk string in RESP2 (as ZSCORE has always replied).
    Double(f64),
    /// RESP3 verbatim string (`=len\r\ntxt:...`, INFO); a bulk string in RESP2.
    Verbatim(Vec<u8>),
}

impl Reply {
    /// `-ERR <msg>`.
    pub fn err(msg: impl std::fmt::Display) -> Reply {
        Reply::Error(format!("ERR {msg}"))
    }

    /// A bulk string from anything byte-like.
    pub fn bulk(b: impl AsRef<[u8]>) -> Reply {
        Reply::Bulk(b.as_ref().to_vec())
    }

    /// Append the RESP2 wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_proto(out, 2);
    }

    /// Append the wire form for protocol `proto` (2 or 3) to `out`.
    pub fn encode_proto(&self, out: &mut Vec<u8>, proto: u8) {
        let resp3 = proto >= 3;
        match self {
            Reply::Ok => out.extend_from_slice(b"+OK\r\n"),
            Reply::Status(s) => line(out, b'+', s.as_bytes()),
            Reply::Error(s) => line(out, b'-', s.as_bytes()),
            Reply::Int(n) => line(out, b':', n.to_string().as_bytes()),
            Reply::Bulk(b) => {
                line(out, b'$', b.len().to_string().as_bytes());
                out.extend_from_slice(b);
                out.extend_from_slice(b"\r\n");
            }
            Reply::Nil | Reply::NilArray if resp3 => out.extend_from_slice(b"_\r\n"),
            Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
            Reply::NilArray => out.extend_from_slice(b"*-1\r\n"),
            Reply::Array(items) => {
                line(out, b'*', items.len().to_string().as_bytes());
                for r in items {
                    r.encode_proto(out, proto);
                }
            }
            Reply::Map(pairs) => {
                if resp3 {
                    line(out, b'%', pairs.len().to_string().as_bytes());
                } else {
                    line(out, b'*', (pairs.len() * 2).to_string().as_bytes());
                }
                for (k, v) in pairs {
                    k.encode_proto(out, proto);
                    v.encode_proto(out, proto);
                }
            }
            Reply::Double(d) => {
                let text = crate::cmd::format_score(*d);
                if resp3 {
                    line(out, b',', text.as_bytes());
                } else {
                    Reply::Bulk(text.into_bytes()).encode_proto(out, proto);
                }
            }
            Reply::Verbatim(b) => {
                if resp3 {
                    line(out, b'=', (b.len() + 4).to_string().as_bytes());
                    out.extend_from_slice(b"txt:");
                    out.extend_from_slice(b);
                    out.extend_from_slice(b"\r\n");
                } else {
                    Reply::Bulk(b.clone()).encode_proto(out, proto);
                }
            }
        }
    }
}

/// `<tag><text>\r\n`; CR and LF inside a status or error line become spaces (as Redis).
fn line(out: &mut Vec<u8>, tag: u8, text: &[u8]) {
    out.push(tag);
    out.extend(text.iter().map(|&c| if c == b'\r' || c == b'\n' { b' ' } else { c }));
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn all(input: &[u8]) -> Result<Vec<Vec<Vec<u8>>>, ProtoError> {
        let mut p = Parser::new();
        let mut buf = BytesMut::from(input);
        let mut out = Vec::new();
        while let Some(c) = p.next(&mut buf, &Limits::default())? {
            out.push(c.iter().map(|b| b.to_vec()).collect());
        }
        Ok(out)
    }

    #[test]
    fn unauthenticated_and_query_buffer_limits() {
        let lim = Limits::default();
        let unauth = || {
            let mut p = Parser::new();
            p.set_authenticated(false);
            p
        };
        let mut buf = BytesMut::from(&b"*11\r\n"[..]);
        assert_eq!(unauth().next(&mut buf, &lim).unwrap_err().0, "Protocol error: unauthenticated multibulk length");
        let mut buf = BytesMut::from(&b"*2\r\n$4\r\nAUTH\r\n$16385\r\n"[..]);
        assert_eq!(unauth().next(&mut buf, &lim).unwrap_err().0, "Protocol error: unauthenticated bulk length");
        // At the limits a command passes; once authenticated, larger ones do.
        let mut p = unauth();
        let mut buf = BytesMut::from(format!("*10\r\n{}", "$1\r\nx\r\n".repeat(10)).as_bytes());
        buf.extend_from_slice(format!("*1\r\n$16384\r\n{}\r\n", "y".repeat(16384)).as_bytes());
        assert_eq!(p.next(&mut buf, &lim).unwrap().unwrap().len(), 10);
        assert_eq!(p.next(&mut buf, &lim).unwrap().unwrap()[0].len(), 16384);
        p.set_authenticated(true);
        buf.extend_from_slice(format!("*11\r\n{}", "$1\r\nx\r\n".repeat(11)).as_bytes());
        buf.extend_from_slice(format!("*1\r\n$16385\r\n{}\r\n", "y".repeat(16385)).as_bytes());
        assert_eq!(p.next(&mut buf, &lim).unwrap().unwrap().len(), 11);
        assert_eq!(p.next(&mut buf, &lim).unwrap().unwrap()[0].len(), 16385);
        // The query-buffer limit counts every argument of one command.
        let lim = Limits { max_query_len: 10, ..Limits::default() };
        let mut p = Parser::new();
        let mut buf =
            BytesMut::from(&b"*2\r\n$3\r\nGET\r\n$7\r\nkkkkkkk\r\n*3\r\n$3\r\nSET\r\n$4\r\nkkkk\r\n$4\r\n"[..]);
        assert_eq!(p.next(&mut buf, &lim).unwrap().unwrap().len(), 2, "10 bytes: at the limit");
        assert_eq!(p.next(&mut buf, &lim).unwrap_err().0, "Protocol error: command larger than the query buffer limit");
    }

    #[test]
    fn multibulk_inline_and_pipelines() {
        let got = all(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\nPING\r\n*0\r\n\r\nset a \"b c\\x41\"\r\n").unwrap();
        let want: Vec<Vec<Vec<u8>>> = vec![
            vec![b"GET".to_vec(), b"k".to_vec()],
            vec![b"PING".to_vec()],
            vec![b"set".to_vec(), b"a".to_vec(), b"b cA".to_vec()],
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn byte_at_a_time_gives_the_same_commands() {
        let input = b"*3\r\n$3\r\nSET\r\n$5\r\nk\r\n\x00y\r\n$0\r\n\r\n*1\r\n$4\r\nPING\r\n";
        let mut p = Parser::new();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for &b in input {
            buf.extend_from_slice(&[b]);
            while let Some(c) = p.next(&mut buf, &Limits::default()).unwrap() {
                got.push(c);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(&got[0][1][..], b"k\r\n\x00y");
        assert_eq!(&got[0][2][..], b"");
    }

    #[test]
    fn redis_protocol_errors() {
        let e = |i: &[u8]| all(i).unwrap_err().0;
        assert_eq!(e(b"*x\r\n"), "Protocol error: invalid multibulk length");
        assert_eq!(e(b"*99999999999\r\n"), "Protocol error: invalid multibulk length");
        assert_eq!(e(b"*1\r\n$-5\r\n"), "Protocol error: invalid bulk length");
        assert_eq!(e(b"*1\r\n$99999999999\r\n"), "Protocol error: invalid bulk length");
        assert_eq!(e(b"*1\r\n+x\r\n"), "Protocol error: expected '$', got '+'");
        assert_eq!(e(b"set \"a\r\n"), "Protocol error: unbalanced quotes in request");
        assert_eq!(e(&vec![b'a'; 70_000]), "Protocol error: too big inline request");
        let mut long = b"*".to_vec();
        long.extend(vec![b'1'; 70_000]);
        assert_eq!(e(&long), "Protocol error: too big mbulk count string");
    }

    #[test]
    fn replies_encode_as_redis() {
        let mut out = Vec::new();
        Reply::Array(vec![Reply::Ok, Reply::Int(-3), Reply::bulk("ab"), Reply::Nil, Reply::err("x\ny")])
            .encode(&mut out);
        assert_eq!(out, b"*5\r\n+OK\r\n:-3\r\n$2\r\nab\r\n$-1\r\n-ERR x y\r\n");
    }

    #[test]
    fn resp3_types_and_their_resp2_forms() {
        let r = Reply::Array(vec![
            Reply::Map(vec![(Reply::bulk("a"), Reply::Double(1.5))]),
            Reply::Nil,
            Reply::NilArray,
            Reply::Double(f64::NEG_INFINITY),
            Reply::Verbatim(b"x".to_vec()),
        ]);
        let mut v3 = Vec::new();
        r.encode_proto(&mut v3, 3);
        assert_eq!(String::from_utf8(v3).unwrap(), "*5\r\n%1\r\n$1\r\na\r\n,1.5\r\n_\r\n_\r\n,-inf\r\n=5\r\ntxt:x\r\n");
        let mut v2 = Vec::new();
        r.encode_proto(&mut v2, 2);
        assert_eq!(
            String::from_utf8(v2).unwrap(),
            "*5\r\n*2\r\n$1\r\na\r\n$3\r\n1.5\r\n$-1\r\n*-1\r\n$4\r\n-inf\r\n$1\r\nx\r\n"
        );
    }
}
