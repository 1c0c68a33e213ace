//! Corpus BLEU with sacreBLEU's defaults: the `13a` tokenizer (mteval-v13a), 4-gram
//! precisions, one reference per line, the standard brevity penalty, `exp` smoothing of
//! n-gram orders with no match, cased unless asked otherwise. Scores are 0-100.
//!
//! Written here rather than taken from a crate because the Rust BLEU crates follow Hugging
//! Face `evaluate` (no smoothing, different tokenizer handling), which differs from sacreBLEU
//! on short corpora.

use std::collections::HashMap;
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;

/// The BLEU of a corpus and its parts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bleu {
    /// Corpus BLEU, 0-100.
    pub bleu: f64,
    /// Modified n-gram precisions for n = 1..4, 0-100.
    pub precisions: [f64; 4],
    /// Brevity penalty.
    pub bp: f64,
    /// Tokens in the hypotheses.
    pub hyp_len: usize,
    /// Tokens in the references.
    pub ref_len: usize,
}

static RULES: LazyLock<[(Regex, &str); 4]> = LazyLock::new(|| {
    [
        // Any punctuation or symbol, unless it is a period or comma next to a digit.
        (
            Regex::new(r"([\x7B-\x7E\x5B-\x60\x20-\x26\x28-\x2B\x3A-\x40\x2F])").unwrap(),
            " $1 ",
        ),
        // Period and comma unless preceded by a digit.
        (Regex::new(r"([^0-9])([\.,])").unwrap(), "$1 $2 "),
        // Period and comma unless followed by a digit.
        (Regex::new(r"([\.,])([^0-9])").unwrap(), " $1 $2"),
        // Dash after a digit.
        (Regex::new(r"([0-9])(-)").unwrap(), "$1 $2 "),
    ]
});

/// sacreBLEU's `13a` tokenization of one line.
pub fn tokenize_13a(line: &str) -> Vec<String> {
    let mut line = line
        .replace("<skipped>", "")
        .replace("-\n", "")
        .replace('\n', " ");
    if line.contains('&') {
        line = line
            .replace("&quot;", "\"")
            .replace("&amp;", "&")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
    }
    let mut line = format!(" {line} ");
    for (re, replacement) in RULES.iter() {
        line = re.replace_all(&line, *replacement).into_owned();
    }
    line.split_whitespace().map(str::to_string).collect()
}

fn ngrams(tokens: &[String], n: usize) -> HashMap<&[String], usize> {
    let mut counts = HashMap::new();
    for gram in tokens.windows(n) {
        *counts.entry(gram).or_insert(0) += 1;
    }
    counts
}

/// Corpus BLEU of `hypotheses` against one reference each (same number of lines).
pub fn corpus_bleu(hypotheses: &[String], references: &[String], lowercase: bool) -> Bleu {
    let mut correct = [0usize; 4];
    let mut total = [0usize; 4];
    let (mut hyp_len, mut ref_len) = (0, 0);
    for (hyp, reference) in hypotheses.iter().zip(references) {
        let prepare = |s: &String| {
            if lowercase {
                tokenize_13a(&s.to_lowercase())
            } else {
                tokenize_13a(s)
            }
        };
        let (h, r) = (prepare(hyp), prepare(reference));
        hyp_len += h.len();
        ref_len += r.len();
        for n in 1..=4 {
            let ref_counts = ngrams(&r, n);
            for (gram, count) in ngrams(&h, n) {
                correct[n - 1] += count.min(ref_counts.get(gram).copied().unwrap_or(0));
            }
            total[n - 1] += h.len().saturating_sub(n - 1);
        }
    }
    let mut precisions = [0.0; 4];
    let mut smooth = 1.0;
    for n in 0..4 {
        if total[n] == 0 {
            break;
        }
        precisions[n] = if correct[n] == 0 {
            smooth *= 2.0;
            100.0 / (smooth * total[n] as f64)
        } else {
            100.0 * correct[n] as f64 / total[n] as f64
        };
    }
    let bp = if hyp_len < ref_len {
        if hyp_len > 0 {
            (1.0 - ref_len as f64 / hyp_len as f64).exp()
        } else {
            0.0
        }
    } else {
        1.0
    };
    let log = |p: f64| if p == 0.0 { -9_999_999_999.0 } else { p.ln() };
    let mean_log = precisions.iter().map(|&p| log(p)).sum::<f64>() / 4.0;
    Bleu {
        bleu: bp * mean_log.exp(),
        precisions,
        bp,
        hyp_len,
        ref_len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn tokenizes_like_mteval_13a() {
        assert_eq!(
            tokenize_13a("Hello, world!"),
            s(&["Hello", ",", "world", "!"])
        );
        assert_eq!(
            tokenize_13a("It costs 3.50 or 1,000."),
            s(&["It", "costs", "3.50", "or", "1,000", "."])
        );
        assert_eq!(
            tokenize_13a("a-b 5-6 \"q\""),
            s(&["a-b", "5", "-", "6", "\"", "q", "\""])
        );
        assert_eq!(
            tokenize_13a("x &amp; y (z)"),
            s(&["x", "&", "y", "(", "z", ")"])
        );
    }

    #[test]
    fn identical_corpus_scores_100() {
        let h = s(&["A man rides a bike.", "Two dogs play in the snow."]);
        let b = corpus_bleu(&h, &h, false);
        assert!((b.bleu - 100.0).abs() < 1e-9);
        assert_eq!(b.precisions, [100.0; 4]);
        assert_eq!((b.hyp_len, b.ref_len, b.bp), (6 + 7, 13, 1.0));
    }

    #[test]
    fn worked_example() {
        // hyp: the cat sat on the mat      (6 tokens)
        // ref: the cat is on the mat today (7 tokens)
        // 1-grams: the x2, cat, on, mat match; sat does not -> 5/6
        // 2-grams: "the cat", "on the", "the mat" match of 5 -> 3/5
        // 3-grams: "on the mat" of 4 -> 1/4
        // 4-grams: none of 3 -> exp smoothing: 100 / (2 * 3)
        // bp = exp(1 - 7/6)
        let b = corpus_bleu(
            &s(&["the cat sat on the mat"]),
            &s(&["the cat is on the mat today"]),
            false,
        );
        let want_p = [500.0 / 6.0, 60.0, 25.0, 100.0 / 6.0];
        for (got, want) in b.precisions.iter().zip(want_p) {
            assert!((got - want).abs() < 1e-9, "{got} vs {want}");
        }
        let bp = (1.0f64 - 7.0 / 6.0).exp();
        let want = bp * (want_p.iter().map(|p| p.ln()).sum::<f64>() / 4.0).exp();
        assert!((b.bleu - want).abs() < 1e-9, "{} vs {want}", b.bleu);
        assert!((b.bp - bp).abs() < 1e-12);
    }

    #[test]
    fn case_matters_unless_lowercased() {
        let h = s(&["The Dog runs fast today ."]);
        let r = s(&["the dog runs fast today ."]);
        let cased = corpus_bleu(&h, &r, false);
        let lower = corpus_bleu(&h, &r, true);
        assert!((lower.bleu - 100.0).abs() < 1e-9);
        // Cased: 4 of 6 unigrams, 3 of 5 bigrams, 2 of 4 trigrams, 1 of 3 four-grams.
        let want = (((4.0f64 / 6.0).ln()
            + (3.0f64 / 5.0).ln()
            + (2.0f64 / 4.0).ln()
            + (1.0f64 / 3.0).ln())
            / 4.0)
            .exp()
            * 100.0;
        assert!((cased.bleu - want).abs() < 1e-9, "{} vs {want}", cased.bleu);
    }
}
