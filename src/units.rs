//! Units at the bottom of the house: human byte sizes for plan keys like `host_memory = "2GiB"`, and
//! the short sizes and counts every message prints. Imports nothing of the crate, so any layer may use it.

/// Parse "2GiB", "512 MiB", "1.5GB", "4096", "64k". Binary (KiB) and decimal (KB) suffixes;
/// a bare `k`/`m`/`g`/`t` is binary.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().ok()?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return None,
    };
    let b = v * mult;
    if !(b.is_finite() && (0.0..1.8e19).contains(&b)) {
        return None;
    }
    Some(b as u64)
}

/// Format bytes as a short binary size ("1.50 GiB").
pub(crate) fn fmt_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < units.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// Bytes as `info` prints sizes, short and exact: "820.31 KiB (840000 bytes)"; "100 B" alone.
pub(crate) fn fmt_bytes_exact(b: u64) -> String {
    match b < 1024 {
        true => fmt_bytes(b),
        false => format!("{} ({b} bytes)", fmt_bytes(b)),
    }
}

/// `n` and the noun that goes with it: "1 tile", "16 tiles".
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("64 MiB"), Some(64 << 20));
        assert_eq!(parse_size("1.5GB"), Some(1_500_000_000));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size("-1G"), None);
        assert_eq!(fmt_bytes(3 << 29), "1.50 GiB");
    }
}
