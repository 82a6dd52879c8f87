//! EVAL, EVALSHA and SCRIPT LOAD/EXISTS/FLUSH: Lua 5.1 scripts, as Redis runs them.
//!
//! Why scripting at all: redis-py's `Lock` (and the lock helpers of most clients) acquire
//! with `SET key token NX PX ms` but release, extend and reacquire with Lua scripts sent by
//! EVALSHA (falling back to SCRIPT LOAD on `-NOSCRIPT`), so without scripts a lock can be
//! taken but never released. Faking those three scripts by recognising their SHA-1 would
//! break on the next client release; this module runs any script with a real Lua 5.1
//! interpreter (the `mlua` crate, which builds the reference Lua from source), as Redis
//! does.
//!
//! - `redis.call` / `redis.pcall` run any tierkv command except those that manage
//!   connections or transactions (AUTH, HELLO, QUIT, MULTI/EXEC/WATCH, EVAL, SCRIPT,
//!   FLUSHDB): `-ERR This Redis command is not allowed from script`. Replies convert between
//!   RESP and Lua with Redis's rules (integer ↔ number, bulk ↔ string, nil bulk → false,
//!   status → `{ok=...}`, error → `{err=...}` or a raised error, array ↔ table; a Lua number
//!   returned is truncated to an integer, `true` is 1, `false` is nil).
//!   `redis.error_reply`, `redis.status_reply` and `redis.sha1hex` exist too.
//! - `cjson.encode` / `cjson.decode` / `cjson.null`, as Redis's bundled lua-cjson: a table
//!   whose keys are exactly 1..n (n ≥ 1) is a JSON array, any other an object (number keys
//!   written as strings; an empty table is `{}`), JSON null is `cjson.null`; NaN, infinities,
//!   functions and strings that are not UTF-8 cannot be encoded (lua-cjson escapes such
//!   bytes instead); nesting is limited to 1,000 levels. Integral numbers below 10^15 are
//!   written as integers, others with the shortest round-trip digits (lua-cjson: `%.14g`).
//! - Isolation and atomicity: a script runs under the global lock taken exclusively (no other
//!   command runs meanwhile) and all its writes are committed as ONE atomic batch when it
//!   ends. A script that raises an error keeps the writes it made before (Redis does not
//!   roll back either).
//! - Sandbox: only Lua's base, table, string and math libraries (no `io`, `os`, `require`,
//!   `loadfile`, `dofile`), a fresh interpreter per call (no globals survive a script),
//!   64 MiB of Lua memory, and a 5-second limit after which the script is aborted with an
//!   error (Redis instead answers `-BUSY` to everyone until SCRIPT KILL).
//! - Not done: `redis.setresp(3)` (scripts see RESP2 replies), `cmsgpack`, `bit`, `struct`,
//!   SCRIPT KILL, EVAL_RO, FUNCTION.

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mlua::{HookTriggers, Lua, LuaOptions, StdLib, Value, Variadic, VmState};
use parking_lot::Mutex;

use crate::cmd::{eq, lookup, parse_int, Keyspace, Session, NOT_INT, R};
use crate::resp::Reply;
use crate::txn::{now_ms, Changes, Txn};

const TIME_LIMIT: Duration = Duration::from_secs(5);
const MEMORY_LIMIT: usize = 64 << 20;
const NOT_FROM_SCRIPT: &[&str] =
    &["auth", "hello", "quit", "multi", "exec", "discard", "watch", "unwatch", "eval", "evalsha", "script", "flushdb"];

/// Scripts loaded by SCRIPT LOAD or EVAL, by SHA-1 (lower-case hex).
#[derive(Debug, Default)]
pub struct Scripts {
    map: Mutex<HashMap<String, Bytes>>,
}

/// SHA-1 of a script, as Redis names it.
pub fn sha1_hex(src: &[u8]) -> String {
    sha1_smol::Sha1::from(src).digest().to_string()
}

/// An error reply raised by `redis.call`, carried through Lua to the script's reply.
#[derive(Debug)]
struct CallError(String);

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CallError {}

fn call_error(e: &mlua::Error) -> Option<String> {
    match e {
        mlua::Error::CallbackError { cause, .. } => call_error(cause),
        mlua::Error::ExternalError(x) => x.downcast_ref::<CallError>().map(|c| c.0.clone()),
        mlua::Error::WithContext { cause, .. } => call_error(cause),
        _ => None,
    }
}

/// A command reply as a Lua value (RESP2 rules).
fn to_lua(lua: &Lua, r: Reply) -> mlua::Result<Value> {
    Ok(match r {
        Reply::Ok => status(lua, "OK")?,
        Reply::Status(s) => status(lua, &s)?,
        Reply::Error(e) => {
            let t = lua.create_table()?;
            t.set("err", e)?;
            Value::Table(t)
        }
        Reply::Int(n) => Value::Number(n as f64),
        Reply::Bulk(b) | Reply::Verbatim(b) => Value::String(lua.create_string(&b)?),
        Reply::Double(d) => Value::String(lua.create_string(crate::cmd::format_score(d))?),
        Reply::Nil | Reply::NilArray => Value::Boolean(false),
        Reply::Array(items) => {
            let t = lua.create_table()?;
            for (i, x) in items.into_iter().enumerate() {
                t.raw_set(i + 1, to_lua(lua, x)?)?;
            }
            Value::Table(t)
        }
        Reply::Map(pairs) => {
            let t = lua.create_table()?;
            for (i, (k, v)) in pairs.into_iter().enumerate() {
                t.raw_set(2 * i + 1, to_lua(lua, k)?)?;
                t.raw_set(2 * i + 2, to_lua(lua, v)?)?;
            }
            Value::Table(t)
        }
    })
}

fn status(lua: &Lua, s: &str) -> mlua::Result<Value> {
    let t = lua.create_table()?;
    t.set("ok", s)?;
    Ok(Value::Table(t))
}

/// A Lua value as a reply (Redis's rules).
fn from_lua(v: &Value) -> Reply {
    match v {
        Value::Integer(n) => Reply::Int(*n),
        Value::Number(n) => Reply::Int(*n as i64),
        Value::String(s) => Reply::Bulk(s.as_bytes().to_vec()),
        Value::Boolean(true) => Reply::Int(1),
        Value::Table(t) => {
            if let Ok(Value::String(e)) = t.raw_get::<Value>("err") {
                return Reply::Error(e.to_string_lossy());
            }
            if let Ok(Value::String(s)) = t.raw_get::<Value>("ok") {
                return Reply::Status(s.to_string_lossy());
            }
            let mut out = Vec::new();
            for i in 1.. {
                match t.raw_get::<Value>(i) {
                    Ok(Value::Nil) | Err(_) => break,
                    Ok(x) => out.push(from_lua(&x)),
                }
            }
            Reply::Array(out)
        }
        _ => Reply::Nil,
    }
}

/// A `redis.call` argument as bytes (strings and numbers only, as Redis).
fn arg_bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::String(s) => Some(s.as_bytes().to_vec()),
        Value::Integer(n) => Some(n.to_string().into_bytes()),
        Value::Number(n) if n.fract() == 0.0 && n.abs() < 1e15 => Some((*n as i64).to_string().into_bytes()),
        Value::Number(n) => Some(format!("{n}").into_bytes()),
        _ => None,
    }
}

/// `cjson.encode` and `cjson.decode` (see the module docs), over `serde_json`.
mod cjson {
    use mlua::{Lua, Value};
    use serde_json::Value as Json;

    const MAX_DEPTH: usize = 1000;

    fn number(n: f64) -> Result<Json, String> {
        if !n.is_finite() {
            return Err("Cannot serialise number: must not be NaN or Inf".into());
        }
        if n.fract() == 0.0 && n.abs() < 1e15 {
            return Ok(Json::from(n as i64));
        }
        serde_json::Number::from_f64(n).map(Json::Number).ok_or_else(|| "Cannot serialise number".to_string())
    }

    fn key(k: &Value) -> Result<String, String> {
        match k {
            Value::String(s) => {
                s.to_str().map(|s| s.to_string()).map_err(|_| "Cannot serialise string: not UTF-8".into())
            }
            Value::Integer(n) => Ok(n.to_string()),
            Value::Number(n) => number(*n).map(|j| j.to_string()),
            _ => Err("Cannot serialise table: table key must be a number or string".into()),
        }
    }

    /// A Lua value as JSON.
    pub(super) fn encode(v: &Value, depth: usize) -> Result<Json, String> {
        if depth > MAX_DEPTH {
            return Err(format!("Cannot serialise, excessive nesting ({})", MAX_DEPTH + 1));
        }
        Ok(match v {
            Value::Nil => Json::Null,
            Value::LightUserData(u) if u.0.is_null() => Json::Null,
            Value::Boolean(b) => Json::Bool(*b),
            Value::Integer(n) => Json::from(*n),
            Value::Number(n) => number(*n)?,
            Value::String(s) => {
                Json::String(s.to_str().map_err(|_| "Cannot serialise string: not UTF-8".to_string())?.to_string())
            }
            Value::Table(t) => {
                let n = t.raw_len();
                let mut pairs = Vec::new();
                for p in t.clone().pairs::<Value, Value>() {
                    pairs.push(p.map_err(|e| e.to_string())?);
                }
                let in_seq = |k: &Value| match k {
                    Value::Integer(i) => *i >= 1 && (*i as usize) <= n,
                    Value::Number(f) => f.fract() == 0.0 && *f >= 1.0 && *f <= n as f64,
                    _ => false,
                };
                if n > 0 && pairs.len() == n && pairs.iter().all(|(k, _)| in_seq(k)) {
                    let mut out = Vec::with_capacity(n);
                    for i in 1..=n {
                        out.push(encode(&t.raw_get::<Value>(i).map_err(|e| e.to_string())?, depth + 1)?);
                    }
                    Json::Array(out)
                } else {
                    let mut out = serde_json::Map::new();
                    for (k, v) in &pairs {
                        out.insert(key(k)?, encode(v, depth + 1)?);
                    }
                    Json::Object(out)
                }
            }
            other => return Err(format!("Cannot serialise {}: type not supported", other.type_name())),
        })
    }

    /// JSON as a Lua value.
    pub(super) fn decode(lua: &Lua, j: &Json) -> mlua::Result<Value> {
        Ok(match j {
            Json::Null => Value::NULL,
            Json::Bool(b) => Value::Boolean(*b),
            Json::Number(n) => match n.as_f64() {
                Some(f) => Value::Number(f),
                None => return Err(mlua::Error::RuntimeError(format!("Expected a number, got {n}"))),
            },
            Json::String(s) => Value::String(lua.create_string(s)?),
            Json::Array(a) => {
                let t = lua.create_table_with_capacity(a.len(), 0)?;
                for (i, x) in a.iter().enumerate() {
                    t.raw_set(i + 1, decode(lua, x)?)?;
                }
                Value::Table(t)
            }
            Json::Object(m) => {
                let t = lua.create_table_with_capacity(0, m.len())?;
                for (k, x) in m {
                    t.raw_set(lua.create_string(k)?, decode(lua, x)?)?;
                }
                Value::Table(t)
            }
        })
    }
}

impl Keyspace {
    pub(crate) fn script_cmd(&self, s: &mut Session, name: &str, a: &[Bytes]) -> R {
        match name {
            "eval" => {
                self.scripts.map.lock().insert(sha1_hex(&a[0]), a[0].clone());
                self.run_script(s, &a[0], &a[1..])
            }
            "evalsha" => {
                let sha = String::from_utf8_lossy(&a[0]).to_ascii_lowercase();
                let src = self.scripts.map.lock().get(&sha).cloned();
                match src {
                    Some(src) => self.run_script(s, &src, &a[1..]),
                    None => Err(Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into())),
                }
            }
            _ => {
                if eq(&a[0], "load") && a.len() == 2 {
                    let src = &a[1];
                    // Compile once, so a syntax error is reported at load time, as Redis does.
                    let lua = Lua::new_with(StdLib::NONE, LuaOptions::default()).map_err(Reply::err)?;
                    lua.load(&src[..])
                        .set_name("@user_script")
                        .into_function()
                        .map_err(|e| Reply::err(format!("Error compiling script (new function): {e}")))?;
                    let sha = sha1_hex(src);
                    self.scripts.map.lock().insert(sha.clone(), src.clone());
                    Ok(Reply::Bulk(sha.into_bytes()))
                } else if eq(&a[0], "exists") && a.len() >= 2 {
                    let m = self.scripts.map.lock();
                    Ok(Reply::Array(
                        a[1..]
                            .iter()
                            .map(|h| {
                                Reply::Int(i64::from(m.contains_key(&String::from_utf8_lossy(h).to_ascii_lowercase())))
                            })
                            .collect(),
                    ))
                } else if eq(&a[0], "flush") && a.len() <= 2 {
                    self.scripts.map.lock().clear();
                    Ok(Reply::Ok)
                } else {
                    Err(Reply::err(format!(
                        "unknown subcommand or wrong number of arguments for '{}'. Try SCRIPT HELP.",
                        String::from_utf8_lossy(&a[0])
                    )))
                }
            }
        }
    }

    fn run_script(&self, s: &mut Session, src: &[u8], rest: &[Bytes]) -> R {
        let numkeys = parse_int(&rest[0]).ok_or_else(|| Reply::err(NOT_INT))?;
        if numkeys < 0 {
            return Err(Reply::err("Number of keys can't be negative"));
        }
        let numkeys = numkeys as usize;
        if numkeys > rest.len() - 1 {
            return Err(Reply::err("Number of keys can't be greater than number of args"));
        }
        let (keys, argv) = rest[1..].split_at(numkeys);
        let lua_err = |e: mlua::Error| Reply::err(format!("Error running script: {e}"));
        let lua =
            Lua::new_with(StdLib::TABLE | StdLib::STRING | StdLib::MATH, LuaOptions::default()).map_err(lua_err)?;
        lua.set_memory_limit(MEMORY_LIMIT).map_err(lua_err)?;
        let started = Instant::now();
        lua.set_hook(HookTriggers::new().every_nth_instruction(10_000), move |_, _| {
            if started.elapsed() > TIME_LIMIT {
                Err(mlua::Error::RuntimeError(format!(
                    "script killed after {} s (tierkv's script time limit)",
                    TIME_LIMIT.as_secs()
                )))
            } else {
                Ok(VmState::Continue)
            }
        });
        let g = self.global.write();
        let now = now_ms();
        // Scripts see RESP2 replies whatever the connection speaks, as in Redis.
        let inner = Session { id: s.id, proto: 2, authed: true, peer: s.peer, ..Session::default() };
        let state = RefCell::new((Changes::default(), inner));
        let run = |protected: bool, lua: &Lua, args: Variadic<Value>| -> mlua::Result<Value> {
            let mut cmd = Vec::with_capacity(args.len());
            for v in args.iter() {
                match arg_bytes(v) {
                    Some(b) => cmd.push(Bytes::from(b)),
                    None => {
                        let e = "ERR Lua redis lib command arguments must be strings or integers".to_string();
                        return if protected {
                            to_lua(lua, Reply::Error(e))
                        } else {
                            Err(mlua::Error::external(CallError(e)))
                        };
                    }
                }
            }
            let reply = if cmd.is_empty() {
                Reply::err("Please specify at least one argument for this redis lib call")
            } else {
                match lookup(&cmd) {
                    Ok(name) if NOT_FROM_SCRIPT.contains(&name) => {
                        Reply::err("This Redis command is not allowed from script")
                    }
                    Ok(_) => {
                        let mut st = state.borrow_mut();
                        let (acc, sess) = &mut *st;
                        self.exec_in(sess, acc, now, &cmd)
                    }
                    Err(e) => e,
                }
            };
            match reply {
                Reply::Error(e) if !protected => Err(mlua::Error::external(CallError(e))),
                r => to_lua(lua, r),
            }
        };
        let result = lua.scope(|scope| {
            let redis = lua.create_table()?;
            redis.set("call", scope.create_function(|lua, args: Variadic<Value>| run(false, lua, args))?)?;
            redis.set("pcall", scope.create_function(|lua, args: Variadic<Value>| run(true, lua, args))?)?;
            redis.set(
                "error_reply",
                lua.create_function(|lua, e: mlua::String| {
                    let t = lua.create_table()?;
                    t.set("err", e)?;
                    Ok(t)
                })?,
            )?;
            redis.set(
                "status_reply",
                lua.create_function(|lua, m: mlua::String| {
                    let t = lua.create_table()?;
                    t.set("ok", m)?;
                    Ok(t)
                })?,
            )?;
            redis.set("sha1hex", lua.create_function(|_, b: mlua::String| Ok(sha1_hex(&b.as_bytes())))?)?;
            let cjson = lua.create_table()?;
            cjson.set(
                "encode",
                lua.create_function(|_, v: Value| {
                    cjson::encode(&v, 0).map(|j| j.to_string()).map_err(mlua::Error::RuntimeError)
                })?,
            )?;
            cjson.set(
                "decode",
                lua.create_function(|lua, s: mlua::String| {
                    let j: serde_json::Value = serde_json::from_slice(&s.as_bytes()).map_err(|e| {
                        mlua::Error::RuntimeError(format!("Expected value but found invalid JSON: {e}"))
                    })?;
                    cjson::decode(lua, &j)
                })?,
            )?;
            cjson.set("null", Value::NULL)?;
            let globals = lua.globals();
            globals.set("redis", redis)?;
            globals.set("cjson", cjson)?;
            globals.set("dofile", Value::Nil)?;
            globals.set("loadfile", Value::Nil)?;
            let to_table = |items: &[Bytes]| -> mlua::Result<mlua::Table> {
                let t = lua.create_table()?;
                for (i, x) in items.iter().enumerate() {
                    t.raw_set(i + 1, lua.create_string(&x[..])?)?;
                }
                Ok(t)
            };
            globals.set("KEYS", to_table(keys)?)?;
            globals.set("ARGV", to_table(argv)?)?;
            let f = lua.load(src).set_name("@user_script").into_function()?;
            let v: Value = f.call(())?;
            Ok(from_lua(&v))
        });
        let (acc, _) = state.into_inner();
        let committed = Txn::exclusive(self, acc, now).commit();
        drop(g);
        committed?;
        match result {
            Ok(r) => Ok(r),
            Err(e) => Err(match call_error(&e) {
                Some(msg) => Reply::Error(msg),
                None => lua_err(e),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn cjson_encodes_and_decodes_as_lua_cjson() {
        let lua = Lua::new();
        let enc = |src: &str| {
            let v: Value = lua.load(src).eval().unwrap();
            cjson::encode(&v, 0).map(|j| j.to_string())
        };
        assert_eq!(enc("return {1, 'a', {k = true}}").unwrap(), r#"[1,"a",{"k":true}]"#);
        assert_eq!(enc("return {}").unwrap(), "{}");
        assert_eq!(enc("return {[1] = 'x', [3] = 'y'}").unwrap(), r#"{"1":"x","3":"y"}"#);
        assert_eq!(enc("return 2.5").unwrap(), "2.5");
        assert_eq!(enc("return 3").unwrap(), "3");
        assert!(enc("return 0/0").unwrap_err().contains("NaN"));
        assert!(enc("return print").unwrap_err().contains("type not supported"));
        assert!(enc("local t = {} t[1] = t return t").unwrap_err().contains("excessive nesting"));
        let j: serde_json::Value = serde_json::from_str(r#"{"a":[1,"two",null],"b":{"c":false}}"#).unwrap();
        let v = cjson::decode(&lua, &j).unwrap();
        lua.globals().set("v", v).unwrap();
        let r: (String, bool, bool, f64) = lua.load("return v.a[2], v.a[3] == nil, v.b.c, v.a[1]").eval().unwrap();
        assert_eq!(r, ("two".to_string(), false, false, 1.0), "JSON null is cjson.null, not nil");
    }

    #[test]
    fn sha1_names_scripts_as_redis() {
        // redis-cli SCRIPT LOAD "return 1" prints this.
        assert_eq!(sha1_hex(b"return 1"), "e0e1f9fabfc9d4800c877a703b823ac0578ff8db");
    }

    #[test]
    fn lua_values_convert_as_redis() {
        let lua = Lua::new();
        let v: Value = lua.load("return {1, 'a', {ok='x'}, false, 2.9, true}").eval().unwrap();
        assert_eq!(
            from_lua(&v),
            Reply::Array(vec![
                Reply::Int(1),
                Reply::bulk("a"),
                Reply::Status("x".into()),
                Reply::Nil,
                Reply::Int(2),
                Reply::Int(1)
            ])
        );
        let v: Value = lua.load("return {err='WRONGTYPE x'}").eval().unwrap();
        assert_eq!(from_lua(&v), Reply::Error("WRONGTYPE x".into()));
        let back = to_lua(&lua, Reply::Array(vec![Reply::Nil, Reply::Int(3)])).unwrap();
        assert_eq!(from_lua(&back), Reply::Array(vec![Reply::Nil, Reply::Int(3)]));
    }
}
