//! The official HotpotQA answer metric (`hotpot_evaluate_v1.py`): answer normalization, exact
//! match and token F1 with the yes/no/noanswer special case.
//!
//! The official script is Python, and its results depend on Python's string semantics, which
//! this module reproduces rather than Rust's: a word character of `re`'s `\b` is `_` or a
//! character of general category L* or N* (`str.isalnum`; Rust's `is_alphanumeric` also counts
//! combining marks such as U+0345 and U+093F and circled letters such as `ⓐ`), and `str.split()`
//! also splits on U+001C–U+001F, which Rust's `is_whitespace` does not. Lower-casing
//! (`str.lower`, final sigma included) and ASCII punctuation agree already.

use std::collections::HashMap;
use unicode_general_category::{get_general_category, GeneralCategory as Cat};

/// Lower-case, drop ASCII punctuation, replace the words a/an/the with a space, collapse
/// whitespace (the official `normalize_answer`).
pub fn normalize_answer(text: &str) -> String {
    let no_punct: String = text
        .to_lowercase()
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = replace_articles(&no_punct);
    python_split(&no_articles).collect::<Vec<_>>().join(" ")
}

/// Python's `str.isspace()`: Unicode White_Space plus the separators U+001C–U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.split()` with no separator: runs of whitespace split, empty pieces dropped.
fn python_split(text: &str) -> impl Iterator<Item = &str> {
    text.split(is_python_space).filter(|t| !t.is_empty())
}

/// A word character of Python's `re` on str patterns: `_` or `str.isalnum()`, which is exactly
/// general category L* or N*.
fn is_python_word(c: char) -> bool {
    use Cat::*;
    c == '_'
        || matches!(
            get_general_category(c),
            UppercaseLetter
                | LowercaseLetter
                | TitlecaseLetter
                | ModifierLetter
                | OtherLetter
                | DecimalNumber
                | LetterNumber
                | OtherNumber
        )
}

/// Replaces every whole word `a`, `an` or `the` (regex `\b(a|an|the)\b`) with a space.
fn replace_articles(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if matches!(word.as_str(), "a" | "an" | "the") {
            out.push(' ');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in text.chars() {
        if is_python_word(c) {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// 1.0 when the normalized prediction equals the normalized gold answer, else 0.0.
pub fn exact_match(prediction: &str, gold: &str) -> f32 {
    f32::from(u8::from(
        normalize_answer(prediction) == normalize_answer(gold),
    ))
}

/// Token F1 (with precision and recall) after normalization. When either side normalizes to
/// yes/no/noanswer and the two differ, all three are 0.
pub fn f1_score(prediction: &str, gold: &str) -> (f32, f32, f32) {
    let (pred, gold) = (normalize_answer(prediction), normalize_answer(gold));
    let special = |s: &str| matches!(s, "yes" | "no" | "noanswer");
    if (special(&pred) || special(&gold)) && pred != gold {
        return (0.0, 0.0, 0.0);
    }
    let pred_tokens: Vec<&str> = python_split(&pred).collect();
    let gold_tokens: Vec<&str> = python_split(&gold).collect();
    let mut gold_counts: HashMap<&str, usize> = HashMap::new();
    for t in &gold_tokens {
        *gold_counts.entry(t).or_default() += 1;
    }
    let mut same = 0usize;
    for t in &pred_tokens {
        if let Some(n) = gold_counts.get_mut(t).filter(|n| **n > 0) {
            *n -= 1;
            same += 1;
        }
    }
    if same == 0 {
        return (0.0, 0.0, 0.0);
    }
    let precision = same as f32 / pred_tokens.len() as f32;
    let recall = same as f32 / gold_tokens.len() as f32;
    (
        2.0 * precision * recall / (precision + recall),
        precision,
        recall,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalization_follows_the_official_rules() {
        let table = [
            ("The Velmora Port", "velmora port"),
            ("  a   cat,  an apple!  ", "cat apple"),
            ("Theatre", "theatre"),
            ("U.S.A.", "usa"),
            ("don't", "dont"),
            ("the-the", "thethe"),
            ("A.", ""),
            ("Ärzte the Band", "ärzte band"),
            ("yes.", "yes"),
            ("tab\there\nnewline", "tab here newline"),
        ];
        for (raw, want) in table {
            assert_eq!(normalize_answer(raw), want, "{raw:?}");
        }
    }

    /// Expected outputs printed by the official `normalize_answer` under Python 3.11 (Unicode
    /// 14): word boundaries at combining marks and circled letters, U+001C–U+001F as spaces.
    #[test]
    fn normalization_follows_python_string_semantics() {
        let table = [
            ("the\u{24b6}", "\u{24d0}"),
            ("\u{24b6} the", "\u{24d0}"),
            ("the \u{24d0} b", "\u{24d0} b"),
            ("the\u{345} x", "\u{345} x"),
            ("a\u{93f} b", "\u{93f} b"),
            ("an\u{345}", "\u{345}"),
            ("x\u{1f}y", "x y"),
            ("the\u{1f}end", "end"),
            ("a\u{1c}\u{1d}\u{1e} b", "b"),
            ("the\u{b2}", "the\u{b2}"),
            ("an\u{663}", "an\u{663}"),
            ("the\u{216b}", "the\u{217b}"),
            (
                "\u{39f}\u{394}\u{39f}\u{3a3} the",
                "\u{3bf}\u{3b4}\u{3bf}\u{3c2}",
            ),
            ("\u{130}stanbul", "i\u{307}stanbul"),
            ("the_x", "thex"),
            ("th\u{e9} a", "th\u{e9}"),
            ("the\u{200b}end", "\u{200b}end"),
            ("a\u{a0}b\u{3000}c", "b c"),
            ("the\u{301} mark", "\u{301} mark"),
            ("1the", "1the"),
        ];
        for (raw, want) in table {
            assert_eq!(normalize_answer(raw), want, "{raw:?}");
        }
        // Token F1 splits as Python does too: U+001F separates two tokens.
        let (f1, _, _) = f1_score("karo\u{1f}zenith", "karo zenith");
        assert_eq!(f1, 1.0);
    }

    #[test]
    fn exact_match_and_f1_on_tricky_cases() {
        // (prediction, gold, em, f1)
        let table: [(&str, &str, f32, f32); 10] = [
            ("The Silent Harbor", "silent harbor", 1.0, 1.0),
            ("Silent Harbor.", "The Silent Harbor", 1.0, 1.0),
            ("yes", "Yes!", 1.0, 1.0),
            ("yes", "no", 0.0, 0.0),
            ("no answer", "noanswer", 0.0, 0.0),
            ("yes it is", "yes", 0.0, 0.0),
            ("Velmora", "Velmora Port", 0.0, 2.0 / 3.0),
            ("port port velmora", "velmora port", 0.0, 0.8),
            ("", "velmora", 0.0, 0.0),
            ("  Karo   Zenith ", "karo zenith", 1.0, 1.0),
        ];
        for (pred, gold, em, f1) in table {
            assert_eq!(exact_match(pred, gold), em, "{pred:?} vs {gold:?}");
            let (got, _, _) = f1_score(pred, gold);
            assert!((got - f1).abs() < 1e-6, "{pred:?} vs {gold:?}: {got}");
        }
        let (_, p, r) = f1_score("velmora", "velmora port");
        assert_eq!((p, r), (1.0, 0.5));
    }
}
