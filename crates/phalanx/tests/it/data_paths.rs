//! What `data.path` patterns expand to (`phalanx::data::paths`) on odd file
//! systems: names that are not UTF-8, and entries that are not regular
//! files (FIFOs, sockets, devices), which are skipped or refused, never
//! opened.

use phalanx::data::paths::expand;
use phalanx::data::{Corpus, CorpusConfig, TokenData, Tokenizer};
use phalanx::fsutil::ScratchDir;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// nanoGPT shard `path` of `n` tokens.
fn write_tokens(path: &Path, n: u16) {
    let bytes: Vec<u8> = (0..n).flat_map(|t| (t % 200).to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: mkfifo(3) on a fresh path of the test's own directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

fn sorted(mut v: Vec<PathBuf>) -> Vec<PathBuf> {
    v.sort();
    v
}

/// A directory whose name is not UTF-8 under `**` made the walk recurse on
/// the same directory until the stack overflowed; with one `*` the empty
/// name it was matched as gave the parent directory itself.
#[test]
fn names_that_are_not_utf8_are_matched_not_a_crash() {
    let d = ScratchDir::new("phalanx-paths", "not-utf8");
    let bad = d.join(OsStr::from_bytes(b"\xff"));
    std::fs::create_dir_all(bad.join("deep")).unwrap();
    let files = [
        bad.join("x.bin"),
        bad.join("deep").join("y.bin"),
        d.join(OsStr::from_bytes(b"a\xff.bin")),
        d.join("z.bin"),
    ];
    for f in &files {
        write_tokens(f, 100);
    }
    // Hidden, also when the rest of its name is not UTF-8.
    write_tokens(&d.join(OsStr::from_bytes(b".\xffhidden.bin")), 100);
    let all = sorted(files.to_vec());
    let glob = format!("{}/**/*.bin", d.display());
    assert_eq!(expand(&glob, "data.path").unwrap(), all);
    // A directory walk finds the same files.
    assert_eq!(expand(d.to_str().unwrap(), "data.path").unwrap(), all);
    // One `*` matches the directory's name, not the empty string.
    let one = format!("{}/*/x.bin", d.display());
    assert_eq!(expand(&one, "data.path").unwrap(), vec![bad.join("x.bin")]);
    let top = format!("{}/*.bin", d.display());
    assert_eq!(
        expand(&top, "data.path").unwrap(),
        sorted(vec![
            d.join(OsStr::from_bytes(b"a\xff.bin")),
            d.join("z.bin")
        ])
    );
    // And the corpus reads them.
    let c = Corpus::open(&CorpusConfig::new(&[&glob], 8)).unwrap();
    assert_eq!(c.train_samples(), Some(4 * 12));
}

/// A FIFO or a socket among token shards is not a shard: skipped by a
/// directory walk and a glob (it used to be taken, then refused).
#[test]
fn fifos_and_sockets_among_token_shards_are_skipped() {
    let d = ScratchDir::new("phalanx-paths", "bin-fifo");
    write_tokens(&d.join("a.bin"), 100);
    mkfifo(&d.join("fifo.bin"));
    let _sock = std::os::unix::net::UnixListener::bind(d.join("sock.bin")).unwrap();
    let want = vec![d.join("a.bin")];
    assert_eq!(expand(d.to_str().unwrap(), "data.path").unwrap(), want);
    let glob = format!("{}/*.bin", d.display());
    assert_eq!(expand(&glob, "data.path").unwrap(), want);
    let c = Corpus::open(&CorpusConfig::new(&[d.to_str().unwrap()], 8)).unwrap();
    assert_eq!(c.train_samples(), Some(12));
}

/// The same among text files, which are opened (to check their first
/// record) before training: a FIFO there hung the run at its start.
#[test]
fn fifos_and_sockets_among_text_files_are_skipped_never_opened() {
    let d = ScratchDir::new("phalanx-paths", "text-fifo");
    std::fs::write(d.join("a.txt"), "some text to train on. ".repeat(20)).unwrap();
    mkfifo(&d.join("fifo.txt"));
    let _sock = std::os::unix::net::UnixListener::bind(d.join("sock.txt")).unwrap();
    assert_eq!(
        expand(d.to_str().unwrap(), "data.path").unwrap(),
        vec![d.join("a.txt")]
    );
    let l = phalanx::data::DataLoader::from_corpus(
        Corpus::open(&CorpusConfig::new(&[d.to_str().unwrap()], 8)).unwrap(),
    );
    l.micro_batch(0, 0, 1, 0, 4, 1).unwrap();
}

/// Named directly, a FIFO or a device is refused naming it, before any
/// open: by the path expansion, and by every reader of a data file.
#[test]
fn a_data_file_that_is_not_regular_is_refused_before_it_is_opened() {
    let d = ScratchDir::new("phalanx-paths", "direct");
    let fifo = d.join("fifo.txt");
    mkfifo(&fifo);
    let dev = Path::new("/dev/zero");
    for p in [fifo.as_path(), dev] {
        let name = p.to_str().unwrap();
        let e = expand(name, "data.path").unwrap_err().to_string();
        assert!(e.contains("not a regular file") && e.contains(name), "{e}");
        let e = TokenData::open(p, Tokenizer::Byte).unwrap_err().to_string();
        assert!(e.contains("not a regular file") && e.contains(name), "{e}");
        let e = phalanx::data::records::documents(p, "text", "data.field", 1)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a regular file") && e.contains(name), "{e}");
        let e = phalanx::data::digest::of_files(&[p.to_path_buf()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file") && e.contains(name), "{e}");
        let spec = phalanx::data::text::TextSpec {
            files: vec![p.to_path_buf()],
            field: "text".into(),
            field_key: "data.field".into(),
            on_bad: phalanx::data::OnBadRecord::Error,
            encoder: std::sync::Arc::new(Tokenizer::Byte),
            shuffle: false,
            seed: 0,
            threads: 1,
            prefetch: 1,
        };
        let e = phalanx::data::text::TextSource::new(spec, 8, Default::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a regular file") && e.contains(name), "{e}");
    }
}

/// A symbolic link back to a directory being walked (`a/up -> ..`) is not
/// followed again: the walk ended only when paths grew too long, listing
/// the same files under ever longer names.
#[test]
fn a_link_to_an_enclosing_directory_is_walked_once() {
    let d = ScratchDir::new("phalanx-paths", "link-loop");
    std::fs::create_dir_all(d.join("a")).unwrap();
    write_tokens(&d.join("a").join("x.bin"), 100);
    write_tokens(&d.join("y.bin"), 100);
    std::os::unix::fs::symlink("..", d.join("a").join("up")).unwrap();
    let want = sorted(vec![d.join("a").join("x.bin"), d.join("y.bin")]);
    let glob = format!("{}/**/*.bin", d.display());
    assert_eq!(expand(&glob, "data.path").unwrap(), want);
    assert_eq!(expand(d.to_str().unwrap(), "data.path").unwrap(), want);
    let glob = format!("{}/**/**/*.bin", d.display());
    assert_eq!(expand(&glob, "data.path").unwrap(), want);
}

/// A directory of token shards gives those only (not `phalanx tokenize`'s
/// state file beside them); another leaves out a dataset's card and
/// metadata beside its data (README, LICENSE, dataset_info.json), and a
/// note names what it left. Markdown and files merely named alike stay.
#[test]
fn a_data_directory_leaves_out_what_is_not_data_and_says_so() {
    use phalanx::data::paths::expand_noting;
    let d = ScratchDir::new("phalanx-paths", "not-data");
    let shards = d.join("shards");
    std::fs::create_dir_all(&shards).unwrap();
    write_tokens(&shards.join("train_000.bin"), 100);
    std::fs::write(shards.join("tokenize.json"), "{\"state\": 1}").unwrap();
    std::fs::write(shards.join("README.md"), "# shards").unwrap();
    let (files, left) = expand_noting(shards.to_str().unwrap(), "data.path").unwrap();
    assert_eq!(files, vec![shards.join("train_000.bin")]);
    assert_eq!(
        sorted(left),
        vec![shards.join("README.md"), shards.join("tokenize.json")]
    );
    let c = Corpus::open(&CorpusConfig::new(&[shards.to_str().unwrap()], 8)).unwrap();
    assert_eq!(c.train_samples(), Some(12));
    let notes = c.notes().join("\n");
    assert!(
        notes.contains("2 file(s) beside its data files") && notes.contains("README.md"),
        "{notes}"
    );

    let hf = d.join("hf");
    std::fs::create_dir_all(hf.join("data")).unwrap();
    std::fs::write(hf.join("README.md"), "---\nlicense: mit\n---\n").unwrap();
    std::fs::write(
        hf.join("data/train.json"),
        "{\"text\": \"one\"}\n{\"text\": \"two\"}\n",
    )
    .unwrap();
    let (files, left) = expand_noting(hf.to_str().unwrap(), "data.path").unwrap();
    assert_eq!(
        (files, left),
        (vec![hf.join("data/train.json")], vec![hf.join("README.md")])
    );

    let text = d.join("text");
    std::fs::create_dir_all(&text).unwrap();
    std::fs::write(text.join("a.txt"), "a").unwrap();
    std::fs::write(text.join("b.jsonl"), "{\"text\": \"b\"}").unwrap();
    std::fs::write(text.join("LICENSE"), "c").unwrap();
    std::fs::write(text.join("dataset_info.json"), "{\n  \"x\": 1\n}\n").unwrap();
    std::fs::write(text.join("chapter.md"), "d").unwrap();
    std::fs::write(text.join("licensed_texts.jsonl"), "{\"text\": \"e\"}").unwrap();
    let (files, left) = expand_noting(text.to_str().unwrap(), "data.path").unwrap();
    assert_eq!(files.len(), 4, "{files:?}");
    assert_eq!(
        sorted(left),
        vec![text.join("LICENSE"), text.join("dataset_info.json")]
    );
}

/// Text to tokenize: a directory's token shards and tokenize's state file
/// are not text (they are left out with a note, instead of the text);
/// one of token shards only is named as such.
#[test]
fn text_to_tokenize_leaves_out_token_shards() {
    use phalanx::data::paths::expand_text_noting;
    let d = ScratchDir::new("phalanx-paths", "text-inputs");
    let dir = d.join("mixed");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.txt"), "a").unwrap();
    std::fs::write(dir.join("README.md"), "# about").unwrap();
    std::fs::write(dir.join("b.jsonl"), "{\"text\": \"b\"}").unwrap();
    write_tokens(&dir.join("old.bin"), 10);
    std::fs::write(dir.join("tokenize.json"), "{}").unwrap();
    let (files, left) = expand_text_noting(dir.to_str().unwrap(), "input").unwrap();
    assert_eq!(files, vec![dir.join("a.txt"), dir.join("b.jsonl")]);
    assert_eq!(
        sorted(left),
        vec![
            dir.join("README.md"),
            dir.join("old.bin"),
            dir.join("tokenize.json")
        ]
    );
    let shards = d.join("shards");
    std::fs::create_dir_all(&shards).unwrap();
    write_tokens(&shards.join("x.bin"), 10);
    let e = expand_text_noting(shards.to_str().unwrap(), "input").unwrap_err();
    assert!(
        e.to_string()
            .contains("directory of token shards, not text"),
        "{e}"
    );
}

/// A `phalanx tokenize` output directory: refused while its state says the
/// run has not finished; once finished, training takes its training
/// shards and `data.val_path` (the same directory) its validation shard.
#[test]
fn a_tokenize_output_directory_splits_training_and_validation() {
    use phalanx::data::paths::{expand_noting, TokenizeRun};
    let d = ScratchDir::new("phalanx-paths", "tokenize-out");
    let out = d.join("out");
    std::fs::create_dir_all(&out).unwrap();
    write_tokens(&out.join("fw_val_000000.bin"), 64);
    write_tokens(&out.join("fw_train_000001.bin"), 200);
    let state = |complete: bool| {
        format!(
            "{{\"format\": \"x\", \"settings\": {{\"prefix\": \"fw\"}}, \"shards\": [{{}}, {{}}], \
             \"complete\": {complete}}}"
        )
    };
    std::fs::write(out.join("tokenize.json"), state(false)).unwrap();
    let e = expand_noting(out.to_str().unwrap(), "data.path").unwrap_err();
    assert!(
        e.to_string()
            .contains("has not finished (2 shard(s) so far)"),
        "{e}"
    );
    let e = Corpus::open(&CorpusConfig::new(&[out.to_str().unwrap()], 8))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("has not finished"), "{e}");
    // (A glob names the shards to read, finished or not.)
    let glob = out.join("fw_train_*.bin");
    assert!(expand_noting(glob.to_str().unwrap(), "data.path").is_ok());

    std::fs::write(out.join("tokenize.json"), state(true)).unwrap();
    let run = TokenizeRun::of(&out).unwrap();
    assert!(run.is_val_shard(&out.join("fw_val_000000.bin")));
    assert!(!run.is_val_shard(&out.join("fw_train_000001.bin")));
    assert!(!run.is_val_shard(&out.join("data_val_000000.bin")));
    let c = Corpus::open(&CorpusConfig::new(&[out.to_str().unwrap()], 8)).unwrap();
    // The training shard's 200 tokens (less a held-out tail where
    // data.val_fraction asks for one), none of the validation shard's 64.
    assert!(c.train_tokens() <= 200, "{}", c.train_tokens());
    let notes = c.notes().join("\n");
    assert!(
        notes.contains("fw_val_000000.bin (phalanx tokenize's held-out split) is not trained on"),
        "{notes}"
    );
    let mut cfg = CorpusConfig::new(&[out.to_str().unwrap()], 8);
    cfg.val_paths = vec![out.to_str().unwrap().to_string()];
    let c = Corpus::open(&cfg).unwrap();
    assert_eq!(c.train_tokens(), 200);
    assert!(!c.notes().join("\n").contains("not trained on"));
}

/// A `.json` file is JSON Lines, as Hugging Face's `json` loader reads it;
/// one holding a JSON array is refused saying so.
#[test]
fn a_json_file_is_json_lines_and_an_array_is_named() {
    use phalanx::data::records::documents;
    let d = ScratchDir::new("phalanx-paths", "json");
    let p = d.join("train.json");
    std::fs::write(&p, "{\"text\": \"one\"}\n{\"text\": \"two\"}\n").unwrap();
    let docs = documents(&p, "text", "data.field", 1).unwrap();
    assert_eq!(docs, vec![Ok("one".to_string()), Ok("two".to_string())]);
    // A byte-order mark before the first record is read past.
    let bom = d.join("bom.jsonl");
    std::fs::write(&bom, "\u{feff}{\"text\": \"one\"}\n{\"text\": \"two\"}\n").unwrap();
    let docs = documents(&bom, "text", "data.field", 1).unwrap();
    assert_eq!(docs, vec![Ok("one".to_string()), Ok("two".to_string())]);
    std::fs::write(&p, "[{\"text\": \"one\"}, {\"text\": \"two\"}]\n").unwrap();
    let docs = documents(&p, "text", "data.field", 1).unwrap();
    let (line, why) = docs[0].clone().unwrap_err();
    assert_eq!(line, 1);
    assert!(why.contains("a JSON array"), "{why}");
}

/// A file or directory whose name holds glob characters is taken as itself
/// when it exists (it used to be read as a pattern that matched nothing);
/// a trailing `**` is every file below, as `**/*`.
#[test]
fn existing_names_with_brackets_and_a_trailing_double_star() {
    let d = ScratchDir::new("phalanx-paths", "brackets");
    let file = d.join("sh[1].bin");
    write_tokens(&file, 64);
    let dir = d.join("br[x]");
    std::fs::create_dir_all(dir.join("deep")).unwrap();
    write_tokens(&dir.join("a.bin"), 64);
    write_tokens(&dir.join("deep").join("b.bin"), 64);
    assert_eq!(
        expand(file.to_str().unwrap(), "data.path").unwrap(),
        vec![file.clone()]
    );
    let below = vec![dir.join("a.bin"), dir.join("deep").join("b.bin")];
    assert_eq!(
        sorted(expand(dir.to_str().unwrap(), "data.path").unwrap()),
        below
    );
    // Still a pattern where no such name exists.
    let pattern = format!("{}/sh?1?.bin", d.display());
    assert_eq!(expand(&pattern, "data.path").unwrap(), vec![file.clone()]);
    let all = format!("{}/**", d.display());
    let every = sorted([below, vec![file]].concat());
    assert_eq!(sorted(expand(&all, "data.path").unwrap()), every);
}

/// A validation text file too short for one sample is named (it was "a
/// text file", which did not say which of several).
#[test]
fn a_short_validation_text_file_is_named() {
    let d = ScratchDir::new("phalanx-paths", "short-val");
    let train = d.join("train.bin");
    write_tokens(&train, 512);
    let val = d.join("val.txt");
    std::fs::write(&val, "too short").unwrap();
    let mut cfg = CorpusConfig::new(&[train.to_str().unwrap()], 64);
    cfg.val_paths = vec![val.display().to_string()];
    let e = Corpus::open(&cfg).err().expect("refused").to_string();
    assert!(
        e.contains(&format!("the validation file {} has", val.display()))
            && e.contains("fewer than seq_len + 1 = 65"),
        "{e}"
    );
}
