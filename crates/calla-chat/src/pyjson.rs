//! JSON text exactly as Python's `json.dumps` writes it.
//!
//! transformers renders chat templates with its own `tojson` filter,
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`, so a
//! tool schema in the prompt reads `{"type": "function", "function": {...}}`: `", "` and `": "` between
//! items, no HTML escaping, non-ASCII kept, key order preserved, floats written as Python's `repr`.
//! The same writer serialises tool-call arguments, so they read as vLLM's do.

use serde_json::Value;

/// The options of `json.dumps` that templates use.
#[derive(Debug, Clone, Default)]
pub struct PyJsonOptions {
    pub ensure_ascii: bool,
    /// None: one line. Some(s): newline + s per nesting level (Python's `indent=n` is n spaces).
    pub indent: Option<String>,
    /// (item separator, key separator); Python's default is (", ", ": "), or (",", ": ") with an indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// `json.dumps(value, ensure_ascii=False)`.
pub fn dumps(value: &Value) -> String {
    dumps_with(value, &PyJsonOptions::default())
}

pub fn dumps_with(value: &Value, opts: &PyJsonOptions) -> String {
    let (item_sep, key_sep) = match &opts.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None if opts.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut writer = Writer {
        out: String::new(),
        opts,
        item_sep,
        key_sep,
    };
    writer.value(value, 0);
    writer.out
}

struct Writer<'a> {
    out: String,
    opts: &'a PyJsonOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl Writer<'_> {
    fn value(&mut self, value: &Value, depth: usize) {
        match value {
            Value::Null => self.out.push_str("null"),
            Value::Bool(true) => self.out.push_str("true"),
            Value::Bool(false) => self.out.push_str("false"),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    self.out.push_str(&i.to_string());
                } else if let Some(u) = n.as_u64() {
                    self.out.push_str(&u.to_string());
                } else {
                    self.out
                        .push_str(&python_float_repr(n.as_f64().unwrap_or(f64::NAN)));
                }
            }
            Value::String(s) => self.string(s),
            Value::Array(items) => {
                if items.is_empty() {
                    self.out.push_str("[]");
                    return;
                }
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(self.item_sep);
                    }
                    self.newline(depth + 1);
                    self.value(item, depth + 1);
                }
                self.newline(depth);
                self.out.push(']');
            }
            Value::Object(map) => {
                if map.is_empty() {
                    self.out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                self.out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(self.item_sep);
                    }
                    self.newline(depth + 1);
                    self.string(key);
                    self.out.push_str(self.key_sep);
                    self.value(item, depth + 1);
                }
                self.newline(depth);
                self.out.push('}');
            }
        }
    }

    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    /// Python's `py_encode_basestring` (ensure_ascii=False) / `py_encode_basestring_ascii`.
    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => self.out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.opts.ensure_ascii && (c as u32) > 0x7e => {
                    // Python escapes everything above '~' as \uXXXX, astral planes as a surrogate pair.
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        self.out.push_str(&format!("\\u{:04x}", unit));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional when the decimal exponent is
/// in (-4, 16], scientific otherwise (`1e-05`, `1e+16`, `1.5e+300`); integral values keep `.0`.
pub fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits as d[.ddd]e[-]X.
    let sci = format!("{:e}", x.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    // Python's decpt: the value is 0.DIGITS × 10^decpt.
    let decpt = exponent + 1;
    let body = if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            format!("0.{}{}", "0".repeat((-decpt) as usize), digits)
        } else if decpt as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(decpt as usize - digits.len()))
        } else {
            let (int_part, frac) = digits.split_at(decpt as usize);
            format!("{int_part}.{frac}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{first}{frac}e{exp_sign}{:02}", exponent.abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_read_like_python_repr() {
        // Expected strings are Python 3's repr() of the same values.
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e16, "1.2345e+16"),
            (123456789.125, "123456789.125"),
            (1e300, "1e+300"),
            (-0.0, "-0.0"),
            (std::f64::consts::PI, "3.141592653589793"),
            (2.718281828459045e-300, "2.718281828459045e-300"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float_repr(x), want, "repr({x})");
        }
    }

    #[test]
    fn dumps_matches_python_defaults() {
        let v = json!({"name": "get_weather", "n": [1, 2.5, true, null], "nested": {}, "list": [], "s": "a\"b\\c\n\u{1}é😀</x>"});
        assert_eq!(
            dumps(&v),
            r#"{"name": "get_weather", "n": [1, 2.5, true, null], "nested": {}, "list": [], "s": "a\"b\\c\n\u0001é😀</x>"}"#
        );
    }

    #[test]
    fn ensure_ascii_escapes_like_python() {
        let v = json!(["é😀~\u{7f}"]);
        let opts = PyJsonOptions {
            ensure_ascii: true,
            ..Default::default()
        };
        assert_eq!(dumps_with(&v, &opts), r#"["\u00e9\ud83d\ude00~\u007f"]"#);
    }

    #[test]
    fn indent_and_sort_keys_like_python() {
        let v = json!({"b": [1, {"x": 1}], "a": {}});
        let opts = PyJsonOptions {
            indent: Some("  ".into()),
            sort_keys: true,
            ..Default::default()
        };
        // json.dumps(v, indent=2, sort_keys=True)
        assert_eq!(
            dumps_with(&v, &opts),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    {\n      \"x\": 1\n    }\n  ]\n}"
        );
    }
}
