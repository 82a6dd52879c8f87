//! Redis's glob-style pattern matching (`stringmatchlen`): `*`, `?`, `[abc]`, `[^a-z]`, and
//! `\` escapes; used by SCAN MATCH and CONFIG GET. Iterative with backtracking to the last
//! `*`, so a hostile pattern costs O(pattern × string), never exponential time.

/// Does `s` match `pattern`?
pub fn matches(pattern: &[u8], s: &[u8]) -> bool {
    let (mut p, mut i) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        if p < pattern.len() {
            match pattern[p] {
                b'*' => {
                    while p < pattern.len() && pattern[p] == b'*' {
                        p += 1;
                    }
                    if p == pattern.len() {
                        return true;
                    }
                    star = Some((p, i));
                    continue;
                }
                _ => {
                    if let Some(np) = one(pattern, p, s[i]) {
                        p = np;
                        i += 1;
                        continue;
                    }
                }
            }
        }
        match star {
            Some((sp, si)) => {
                p = sp;
                i = si + 1;
                star = Some((sp, si + 1));
            }
            None => return false,
        }
    }
    while p < pattern.len() && pattern[p] == b'*' {
        p += 1;
    }
    p == pattern.len()
}

/// Match one character at `pattern[p]` (not `*`) against `c`: the next pattern position.
fn one(pattern: &[u8], p: usize, c: u8) -> Option<usize> {
    match pattern[p] {
        b'?' => Some(p + 1),
        b'[' => {
            let mut q = p + 1;
            let not = pattern.get(q) == Some(&b'^');
            if not {
                q += 1;
            }
            let mut hit = false;
            loop {
                match pattern.get(q) {
                    None => {
                        // Unterminated class: Redis treats the end as closing it.
                        break;
                    }
                    Some(b']') => {
                        q += 1;
                        break;
                    }
                    Some(b'\\') if q + 1 < pattern.len() => {
                        hit |= pattern[q + 1] == c;
                        q += 2;
                    }
                    Some(&lo)
                        if pattern.get(q + 1) == Some(&b'-') && q + 2 < pattern.len() && pattern[q + 2] != b']' =>
                    {
                        let hi = pattern[q + 2];
                        let (a, b) = if lo <= hi { (lo, hi) } else { (hi, lo) };
                        hit |= a <= c && c <= b;
                        q += 3;
                    }
                    Some(&x) => {
                        hit |= x == c;
                        q += 1;
                    }
                }
            }
            (hit != not).then_some(q)
        }
        b'\\' if p + 1 < pattern.len() => (pattern[p + 1] == c).then_some(p + 2),
        x => (x == c).then_some(p + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn redis_glob_cases() {
        for (p, s, want) in [
            ("*", "", true),
            ("*", "abc", true),
            ("a*c", "abbbc", true),
            ("a*c", "abbbd", false),
            ("h?llo", "hello", true),
            ("h[ae]llo", "hallo", true),
            ("h[^e]llo", "hello", false),
            ("h[a-b]llo", "hbllo", true),
            ("h\\*llo", "h*llo", true),
            ("h\\*llo", "hello", false),
            ("key:*:x", "key:12:x", true),
            ("*a*a*a*a*a*a*a*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", false),
        ] {
            assert_eq!(matches(p.as_bytes(), s.as_bytes()), want, "{p} ~ {s}");
        }
    }
}
