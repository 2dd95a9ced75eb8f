//! `phalanx tokenize --output-dir`: many text and JSONL inputs into llm.c
//! shards. The shards decode back to the input documents (gpt2 and byte,
//! a glob of several files); the bytes do not depend on the thread count;
//! shard and validation sizes are as asked; a run stopped after any shard
//! resumes to the bytes of an uninterrupted one; bad inputs and unsafe
//! output directories are refused by name; the shards train. And the
//! single-file form (INPUT OUTPUT) still writes one `.bin`.

use crate::common;
use common::*;

use phalanx::data::Tokenizer;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const HOOK: &str = "PHALANX_TOKENIZE_STOP_AFTER_SHARDS";

/// `template` split at whitespace, every word that is a key of `paths`
/// replaced by that path (so paths may hold spaces).
fn argv(template: &str, paths: &[(&str, &Path)]) -> Vec<String> {
    template
        .split_whitespace()
        .map(|w| match paths.iter().find(|(k, _)| *k == w) {
            Some((_, p)) => p.display().to_string(),
            None => w.to_string(),
        })
        .collect()
}

/// `phalanx tokenize ARGS` in the repository, with `env` set.
fn tokenize_env(args: &[String], env: &[(&str, &str)]) -> Run {
    let mut c = Command::new(BIN);
    c.arg("tokenize")
        .args(args)
        .current_dir(repo())
        .env_remove(HOOK);
    for (k, v) in env {
        c.env(k, v);
    }
    run_until(c, Duration::from_secs(120))
}

/// `phalanx tokenize` with [`argv`]`(template, paths)`.
fn tokenize(template: &str, paths: &[(&str, &Path)]) -> Run {
    tokenize_env(&argv(template, paths), &[])
}

/// An llm.c file: (magic, version, tokens), its length checked against the header.
fn read_bin(p: &Path) -> (u32, u32, Vec<u32>) {
    let b = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let word = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    let (magic, version, n) = (word(0), word(1), word(2) as usize);
    let width = if magic == 20240520 { 2 } else { 4 };
    assert_eq!(
        b.len(),
        1024 + n * width,
        "{}: size against header",
        p.display()
    );
    let body = &b[1024..];
    let tokens = if width == 2 {
        body.chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect()
    } else {
        body.chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    (magic, version, tokens)
}

/// The `.bin` names in `dir`, sorted (the val shard first: `val` > `train`
/// would sort after, so it is put first by hand).
fn shards(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".bin"))
        .collect();
    v.sort_by_key(|n| (!n.contains("_val_"), n.clone()));
    v
}

/// Every token of the run in `dir`, shards in order.
fn stream(dir: &Path) -> Vec<u32> {
    shards(dir)
        .iter()
        .flat_map(|n| read_bin(&dir.join(n)).2)
        .collect()
}

/// The bytes of every file in `dir`, by name.
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Inputs of every kind, and the documents they hold in glob order:
/// `a.txt` (one document), `b.jsonl` (records with unicode, escaped
/// newlines, an empty text, a literal `<|endoftext|>`, CRLF, blank lines),
/// `c.txt`, `d.jsonl` (larger than one 2 MiB read chunk when `big`).
fn make_inputs(dir: &Path, big: bool) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    let corpus = std::fs::read_to_string(repo().join("data/corpus.txt")).unwrap();
    let cut = (20_000..).find(|&i| corpus.is_char_boundary(i)).unwrap();
    let a = corpus[..cut].to_string();
    std::fs::write(dir.join("a.txt"), &a).unwrap();
    let b_docs = [
        "Héllo wörld — ünïcode ✓ 日本語",
        "two\nlines\n",
        "",
        "text with <|endoftext|> inside",
        "  leading and trailing spaces  ",
    ];
    let mut b = String::new();
    for (i, t) in b_docs.iter().enumerate() {
        b.push_str(&serde_json::json!({ "id": i, "text": t }).to_string());
        b.push_str(if i == 1 { "\r\n\n   \n" } else { "\n" });
    }
    std::fs::write(dir.join("b.jsonl"), &b).unwrap();
    let c = "The end.\n".to_string();
    std::fs::write(dir.join("c.txt"), &c).unwrap();
    let lines: Vec<&str> = corpus.lines().collect();
    let take = if big { lines.len() } else { 400 };
    let mut d = String::new();
    let mut d_docs = Vec::new();
    for group in lines[..take].chunks(5) {
        let t = group.join("\n");
        d.push_str(&serde_json::json!({ "text": t, "meta": { "n": group.len() } }).to_string());
        d.push('\n');
        d_docs.push(t);
    }
    if big {
        assert!(d.len() > 3 << 20, "several read chunks");
    }
    std::fs::write(dir.join("d.jsonl"), &d).unwrap();
    let mut docs = vec![a];
    docs.extend(b_docs.iter().map(|t| t.to_string()));
    docs.push(c);
    docs.extend(d_docs);
    docs
}

#[test]
fn shards_decode_to_the_input_documents() {
    let d = fresh_dir("phalanx-tokenize", "roundtrip");
    let docs = make_inputs(&d.join("in"), false);
    let glob = d.join("in").join("*");
    for enc in ["gpt2", "byte"] {
        let out = d.join(enc);
        let r = tokenize(
            &format!("--encoding {enc} --output-dir OUT --shard-size 700 --val-tokens 150 GLOB"),
            &[("OUT", &out), ("GLOB", &glob)],
        );
        assert_eq!(r.code, 0, "{r}");
        let n = docs.len();
        assert!(
            r.out.contains(&format!("{n} documents from 4 files")),
            "{r}"
        );
        assert!(r.err.contains("files 4/4"), "a final progress line: {r}");
        let tokens = stream(&out);
        let tok = Tokenizer::from_name(enc).unwrap();
        if enc == "gpt2" {
            // The end-of-text token before every document, and only there.
            let pieces: Vec<&[u32]> = tokens.split(|&t| t == 50256).collect();
            assert!(pieces[0].is_empty(), "the stream starts with <|endoftext|>");
            let decoded: Vec<String> = pieces[1..].iter().map(|p| tok.decode(p).unwrap()).collect();
            assert_eq!(decoded.len(), n);
            for (i, (got, want)) in decoded.iter().zip(&docs).enumerate() {
                assert_eq!(got, want, "document {i}");
            }
        } else {
            // byte: a newline byte before every document.
            let want: String = docs.iter().map(|t| format!("\n{t}")).collect();
            assert_eq!(tok.decode(&tokens).unwrap(), want);
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn output_bytes_do_not_depend_on_the_thread_count() {
    let d = fresh_dir("phalanx-tokenize", "threads");
    make_inputs(&d.join("in"), true);
    let runs: Vec<Vec<(String, Vec<u8>)>> = ["1", "3"]
        .iter()
        .map(|t| {
            let out = d.join(format!("t{t}"));
            let r = tokenize(
                &format!("--encoding gpt2 --output-dir OUT --shard-size 300K --val-tokens 5000 --threads {t} IN"),
                &[("OUT", &out), ("IN", &d.join("in"))],
            );
            assert_eq!(r.code, 0, "{r}");
            contents(&out)
        })
        .collect();
    assert!(runs[0].len() >= 4, "several shards: {}", runs[0].len());
    let names = |r: &[(String, Vec<u8>)]| r.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&runs[0]), names(&runs[1]));
    for ((n, a), (_, b)) in runs[0].iter().zip(&runs[1]) {
        assert!(a == b, "{n} differs between --threads 1 and 3");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn shard_and_validation_sizes_are_as_asked() {
    let d = fresh_dir("phalanx-tokenize", "sizes");
    let docs = make_inputs(&d.join("in"), false);
    // byte: the stream is known exactly, one token per byte.
    let want: Vec<u32> = docs
        .iter()
        .flat_map(|t| std::iter::once(10).chain(t.bytes().map(u32::from)))
        .collect();
    let (out, input) = (d.join("out"), d.join("in"));
    let r = tokenize(
        "--encoding byte --output-dir OUT --shard-size 1K --val-tokens 333 --prefix corpus IN",
        &[("OUT", &out), ("IN", &input)],
    );
    assert_eq!(r.code, 0, "{r}");
    let names = shards(&out);
    let train = want.len() - 333;
    assert_eq!(names.len(), 1 + train.div_ceil(1000), "{names:?}");
    assert_eq!(names[0], "corpus_val_000000.bin");
    let mut at = 0;
    for (i, n) in names.iter().enumerate() {
        let (magic, version, tokens) = read_bin(&out.join(n));
        assert_eq!((magic, version), (20240520, 1), "{n}: uint16 llm.c header");
        let size = match i {
            0 => 333,
            _ if i == names.len() - 1 => train - 1000 * (names.len() - 2),
            _ => 1000,
        };
        if i > 0 {
            assert_eq!(n, &format!("corpus_train_{i:06}.bin"));
        }
        assert_eq!(tokens.len(), size, "{n}");
        assert_eq!(tokens, want[at..at + size], "{n}");
        at += size;
    }
    // Without --val-tokens, no validation shard: training starts at 000001.
    let out = d.join("noval");
    let r = tokenize(
        "--encoding byte --output-dir OUT --shard-size 4000 IN",
        &[("OUT", &out), ("IN", &input)],
    );
    assert_eq!(r.code, 0, "{r}");
    assert_eq!(shards(&out)[0], "data_train_000001.bin");
    assert_eq!(stream(&out), want);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_stopped_run_resumes_to_the_same_bytes() {
    let d = fresh_dir("phalanx-tokenize", "resume");
    make_inputs(&d.join("in"), true);
    let glob = d.join("in").join("*");
    let args = |out: &Path| {
        argv(
            "--encoding gpt2 --output-dir OUT --shard-size 150K --val-tokens 20K GLOB",
            &[("OUT", out), ("GLOB", &glob)],
        )
    };
    let reference = d.join("ref");
    let r = tokenize_env(&args(&reference), &[]);
    assert_eq!(r.code, 0, "{r}");
    let want = contents(&reference);
    assert!(
        want.len() > 6,
        "enough shards to stop between: {}",
        want.len()
    );

    let out = d.join("out");
    let a = args(&out);
    let r = tokenize_env(&a, &[(HOOK, "2")]);
    assert_eq!(r.code, 137, "stopped by the hook: {r}");
    // Only complete shards, and the state naming them.
    assert_eq!(
        shards(&out),
        ["data_val_000000.bin", "data_train_000001.bin"]
    );
    let st = std::fs::read_to_string(out.join("tokenize.json")).unwrap();
    let st: serde_json::Value = serde_json::from_str(&st).unwrap();
    assert_eq!(st["shards"].as_array().unwrap().len(), 2);
    assert_eq!(st["complete"], false);
    // The trainer does not take a part of the data for the whole.
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .env_remove("RANK")
        .args(["train", "--nproc-per-node", "1"])
        .args(train_args(&d.join("log.jsonl"), 1))
        .args(["--set", &format!("data.path=\"{}\"", out.display())]);
    let t = run_until(c, Duration::from_secs(120));
    assert_ne!(t.code, 0, "{t}");
    assert!(
        t.err
            .contains("tokenize.json says the `phalanx tokenize` run")
            && t.err.contains("has not finished (2 shard(s) so far)"),
        "{t}"
    );
    // What a kill leaves at worst: a temporary, and a shard renamed into
    // place before the state recorded it (here with wrong contents).
    std::fs::write(out.join(".data_train_000002.bin.tmp-4242"), b"half").unwrap();
    std::fs::write(out.join("data_train_000002.bin"), b"not this").unwrap();
    // Then one shard per run until it completes: every resume point.
    let mut runs = 0;
    loop {
        runs += 1;
        assert!(runs < 40, "does not complete");
        let r = tokenize_env(&a, &[(HOOK, "1")]);
        assert!(r.out.contains("resuming"), "{r}");
        if r.code == 0 {
            break;
        }
        assert_eq!(r.code, 137, "{r}");
    }
    assert!(runs > 3, "{runs}");
    assert!(
        contents(&out) == want,
        "the resumed run's files differ from the reference"
    );
    // A complete run is left as it is.
    let r = tokenize_env(&a, &[]);
    assert!(r.code == 0 && r.out.contains("is complete"), "{r}");
    assert!(contents(&out) == want);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn other_settings_are_refused_and_force_starts_over() {
    let d = fresh_dir("phalanx-tokenize", "settings");
    make_inputs(&d.join("in"), false);
    let (out, input) = (d.join("out"), d.join("in"));
    let run = |extra: &str| {
        let t = format!("--encoding byte --output-dir OUT IN {extra}");
        tokenize(&t, &[("OUT", &out), ("IN", &input)])
    };
    assert_eq!(run("--shard-size 2000").code, 0);
    let r = run("--shard-size 3000");
    assert!(
        r.code == 1 && r.err.contains("--shard-size: 2000 there, 3000 now"),
        "{r}"
    );
    let r = run("--shard-size 2000 --val-tokens 100");
    assert!(
        r.code == 1 && r.err.contains("--val-tokens: 0 there, 100 now"),
        "{r}"
    );
    // A changed input is named.
    std::fs::write(input.join("c.txt"), "Another end, longer.\n").unwrap();
    let r = run("--shard-size 2000");
    assert!(r.code == 1 && r.err.contains("c.txt changed size"), "{r}");
    let r = run("--shard-size 3000 --force");
    assert_eq!(r.code, 0, "{r}");
    assert!(shards(&out).iter().all(|n| n.starts_with("data_train_")));
    assert_eq!(read_bin(&out.join("data_train_000001.bin")).2.len(), 3000);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_inputs_are_named() {
    let d = fresh_dir("phalanx-tokenize", "bad");
    let w = |name: &str, bytes: &[u8]| {
        std::fs::write(d.join(name), bytes).unwrap();
        d.join(name)
    };
    let good = w("good.txt", b"some text\n");
    let bad_json = w("broken.jsonl", b"{\"text\": \"ok\"}\n\n{\"text\": oops}\n");
    let paths: &[(&str, &Path)] = &[
        ("OUT", &d.join("out")),
        ("GOOD", &good),
        ("LATIN1", &w("latin1.txt", b"caf\xe9\n")),
        ("BROKEN", &bad_json),
        ("NOFIELD", &w("nofield.jsonl", b"{\"content\": \"x\"}\n")),
        ("BLANK", &w("blank.jsonl", b"\n  \n")),
        ("EMPTYTXT", &w("empty.txt", b"")),
        ("GZ", &w("x.jsonl.gz", b"\x1f\x8b")),
        ("PARQUET", &w("x.parquet", b"PAR1\x00\xff\x00PAR1")),
        ("EMPTY", &d.join("empty")),
        ("MISSING", &d.join("missing.txt")),
        ("NOTHING", &d.join("*.nothing")),
    ];
    std::fs::create_dir_all(d.join("empty")).unwrap();
    // (arguments after --output-dir OUT, exit code, words the message holds)
    let cases: &[(&str, i32, &[&str])] = &[
        (
            "--encoding gpt2 MISSING",
            1,
            &["missing.txt", "no such file"],
        ),
        (
            "--encoding gpt2 NOTHING",
            1,
            &["*.nothing", "matches no file"],
        ),
        ("--encoding gpt2 EMPTY", 1, &["empty", "no data files"]),
        (
            "--encoding gpt2 LATIN1",
            1,
            &["latin1.txt", "line 1", "UTF-8"],
        ),
        (
            "--encoding gpt2 GOOD BROKEN",
            1,
            &["broken.jsonl", "line 3", "JSON"],
        ),
        (
            "--encoding byte NOFIELD",
            1,
            &["nofield.jsonl", "line 1", "no field \"text\""],
        ),
        ("--encoding byte BLANK", 1, &["no documents"]),
        // (An empty text file is no document either: it used to be one,
        // written as a lone separator.)
        ("--encoding byte EMPTYTXT", 1, &["no documents"]),
        ("--encoding byte GZ", 1, &["x.jsonl.gz", "compressed"]),
        ("--encoding byte PARQUET", 1, &["x.parquet"]),
        (
            "--encoding bpe GOOD",
            1,
            &["--encoding \"bpe\"", "gpt2, byte"],
        ),
        (
            "--encoding byte --shard-size 0 GOOD",
            1,
            &["--shard-size 0"],
        ),
        (
            "--encoding byte --shard-size 5G GOOD",
            1,
            &["--shard-size 5000000000", "4294967295"],
        ),
        (
            "--encoding byte --shard-size lots GOOD",
            2,
            &["--shard-size", "lots"],
        ),
        (
            "--encoding byte --val-tokens 1M GOOD",
            1,
            &["only 11 tokens", "--val-tokens 1000000"],
        ),
        (
            "--encoding byte --prefix ../up GOOD",
            1,
            &["--prefix \"../up\""],
        ),
        ("--encoding byte --bos <s> GOOD", 1, &["--bos \"<s>\""]),
        (
            "--encoding byte --tokenizer GOOD GOOD",
            2,
            &["cannot be used with"],
        ),
        ("GOOD", 2, &["--tokenizer", "--encoding"]),
    ];
    for (args, code, want) in cases {
        let r = tokenize(&format!("--output-dir OUT {args}"), paths);
        assert_eq!(r.code, *code, "{args}: {r}");
        for w in *want {
            assert!(
                r.err.contains(w),
                "{args}: the message should name {w:?}: {r}"
            );
        }
        let _ = std::fs::remove_dir_all(d.join("out"));
    }
    // Without --output-dir: shard flags, and more than INPUT OUTPUT.
    let r = tokenize("--encoding byte --field body GOOD OUT", paths);
    assert!(
        r.code == 1 && r.err.contains("--field is for sharded output"),
        "{r}"
    );
    let r = tokenize("--encoding byte GOOD BLANK OUT", paths);
    assert!(r.code == 1 && r.err.contains("--output-dir"), "{r}");
    // A run stopped by a bad record before its first shard leaves its
    // state; other options then start over without --force.
    let r = tokenize("--encoding byte --output-dir OUT GOOD BROKEN", paths);
    assert_eq!(r.code, 1, "{r}");
    assert!(d.join("out/tokenize.json").exists(), "{r}");
    // Skipped instead, and counted.
    let t = "--encoding byte --output-dir OUT --on-bad-record skip GOOD BROKEN NOFIELD LATIN1";
    let r = tokenize(t, paths);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("skipped 3 bad records"), "{r}");
    let kept = Tokenizer::Byte.decode(&stream(&d.join("out"))).unwrap();
    assert_eq!(kept, "\nsome text\n\nok");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn output_directories_that_are_not_ours_are_refused() {
    let d = fresh_dir("phalanx-tokenize", "dirs");
    let input = d.join("in");
    make_inputs(&input, false);
    let run = |out: &Path, rest: &str, p: &Path| {
        let t = format!("--encoding byte --output-dir OUT {rest}");
        tokenize(&t, &[("OUT", out), ("IN", p)])
    };
    // A directory holding someone else's file, even with --force.
    let other = d.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "keep me").unwrap();
    for rest in ["IN", "IN --force"] {
        let r = run(&other, rest, &input);
        assert!(
            r.code == 1 && r.err.contains("did not write (notes.txt)"),
            "{r}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(other.join("notes.txt")).unwrap(),
        "keep me"
    );
    // An input inside the output directory.
    let r = run(&input, "IN", &input.join("a.txt"));
    assert!(
        r.code == 1 && r.err.contains("is inside --output-dir"),
        "{r}"
    );
    // The output directory inside an input directory.
    let r = run(&input.join("shards"), "IN", &input);
    assert!(
        r.code == 1 && r.err.contains("is inside input directory"),
        "{r}"
    );
    assert!(!input.join("shards").exists());
    let _ = std::fs::remove_dir_all(&d);
}

/// A word-level `tokenizer.json`: 5 words and `</s>` (id 4).
const TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "unk_token": "[UNK]",
            "vocab": {"[UNK]": 0, "in": 1, "the": 2, "beginning": 3, "</s>": 4, "god": 5}}
}"#;

#[test]
fn a_tokenizer_json_separates_with_its_end_of_text_token() {
    let d = fresh_dir("phalanx-tokenize", "hf");
    std::fs::write(d.join("tokenizer.json"), TOKENIZER).unwrap();
    let docs = d.join("docs.jsonl");
    std::fs::write(
        &docs,
        "{\"text\": \"in the beginning\"}\n{\"text\": \"god\"}\n",
    )
    .unwrap();
    let out = d.join("out");
    let paths: &[(&str, &Path)] = &[("TOK", &d), ("OUT", &out), ("DOCS", &docs)];
    let r = tokenize("--tokenizer TOK --output-dir OUT DOCS", paths);
    assert_eq!(r.code, 0, "{r}");
    assert!(r.out.contains("</s> (4) before every document"), "{r}");
    assert_eq!(stream(&out), [4, 1, 2, 3, 4, 5]);
    // --bos puts another token there.
    let r = tokenize(
        "--tokenizer TOK --output-dir OUT --bos the --force DOCS",
        paths,
    );
    assert_eq!(r.code, 0, "{r}");
    assert_eq!(stream(&out), [2, 1, 2, 3, 2, 5]);
    // Without an end-of-text token, --bos is asked for.
    std::fs::write(
        d.join("tokenizer.json"),
        TOKENIZER.replace("</s>", "created"),
    )
    .unwrap();
    let _ = std::fs::remove_dir_all(&out);
    let r = tokenize("--tokenizer TOK --output-dir OUT DOCS", paths);
    assert!(r.code == 1 && r.err.contains("give --bos"), "{r}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_single_file_form_writes_one_bin() {
    let d = fresh_dir("phalanx-tokenize", "single");
    let text = "héllo\nworld\n";
    std::fs::write(d.join("t.txt"), text).unwrap();
    let paths: &[(&str, &Path)] = &[("TXT", &d.join("t.txt")), ("BIN", &d.join("t.bin"))];
    let r = tokenize("--encoding byte TXT BIN", paths);
    assert_eq!(r.code, 0, "{r}");
    let (magic, version, tokens) = read_bin(&d.join("t.bin"));
    assert_eq!((magic, version), (20240520, 1));
    assert_eq!(
        tokens,
        text.bytes().map(u32::from).collect::<Vec<_>>(),
        "no separator"
    );
    let r = tokenize("--encoding gpt2 --bos <|endoftext|> --force TXT BIN", paths);
    assert_eq!(r.code, 0, "{r}");
    let tokens = read_bin(&d.join("t.bin")).2;
    assert_eq!(tokens[0], 50256);
    assert_eq!(Tokenizer::Gpt2.decode(&tokens[1..]).unwrap(), text);
    // An output that is the input is refused, --force or not.
    let r = tokenize("--encoding byte --force BIN BIN", paths);
    assert!(
        r.code == 1 && r.err.contains("refusing to overwrite an input"),
        "{r}"
    );
    // So is an output that is the tokenizer.json.
    let r = tokenize("--tokenizer BIN --force TXT BIN", paths);
    assert!(
        r.code == 1 && r.err.contains("refusing to overwrite an input"),
        "{r}"
    );
    // An empty input gives no file the trainer could read: refused, and
    // the earlier output is left as it was.
    std::fs::write(d.join("t.txt"), "").unwrap();
    let before = std::fs::read(d.join("t.bin")).unwrap();
    let r = tokenize("--encoding byte --force TXT BIN", paths);
    assert!(
        r.code == 1 && r.err.contains("holds no text to encode"),
        "{r}"
    );
    assert_eq!(std::fs::read(d.join("t.bin")).unwrap(), before);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_shards_train() {
    let d = fresh_dir("phalanx-tokenize", "train");
    let out = d.join("shards");
    let r = tokenize(
        "--encoding byte --output-dir OUT --shard-size 1M --val-tokens 50K data/corpus.txt",
        &[("OUT", &out)],
    );
    assert_eq!(r.code, 0, "{r}");
    assert!(shards(&out).len() >= 5, "{:?}", shards(&out));
    let log = d.join("log.jsonl");
    let set = |k: &str, p: &Path| ["--set".to_string(), format!("{k}=\"{}\"", p.display())];
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .env_remove("RANK")
        .args(["train", "--nproc-per-node", "1"])
        .args(train_args(&log, 2))
        // The output directory: its training shards, and its validation
        // shard for validation.
        .args(set("data.path", &out))
        .args(set("data.val_path", &out))
        .args([
            "--set",
            "train.eval_interval=2",
            "--set",
            "train.eval_batches=1",
        ]);
    let r = run_until(c, Duration::from_secs(240));
    assert_eq!(r.code, 0, "{r}");
    assert_eq!(losses(&log).len(), 2);
    assert!(
        r.out.contains("val "),
        "evaluated on the validation shard: {r}"
    );
    // Its corpus line counts the training shards' tokens only.
    let train_tokens: u64 = shards(&out)
        .iter()
        .filter(|s| s.contains("_train_"))
        .map(|s| read_bin(&out.join(s)).2.len() as u64)
        .sum();
    assert!(
        r.out.contains(&format!("{train_tokens} train")),
        "{train_tokens} training tokens: {r}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
