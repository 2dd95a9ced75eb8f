//! `phalanx generate` from what training leaves, as a user runs it: the
//! distributed checkpoint of a tensor-parallel run (Llama with its kv heads
//! split and replicated, and GPT-2) generates the same tokens as the same
//! weights gathered into one model by `--save-final`; `data.tokenizer`
//! naming a `tokenizer.json` trains on a text file, goes beside the saved
//! model, and `generate` reads it (from the saved model and from the
//! checkpoint); a tokenizer larger than the model, or missing, is named.

use crate::common;
use common::*;

/// 2-rank training with `flags` (the model's), `steps` steps, a checkpoint
/// at the end in `ck`, the whole model saved to `full`.
fn train_tp(flags: &[&str], extra: &[&str], ck: &std::path::Path, full: &std::path::Path) {
    let ck_set = format!("checkpoint.dir=\"{}\"", ck.display());
    let mut a = vec![
        "train",
        "--nproc-per-node",
        "2",
        "--set",
        "train.steps=3",
        "--set",
        "checkpoint.interval=3",
        "--set",
        &ck_set,
        "--save-final",
        full.to_str().unwrap(),
    ];
    a.extend_from_slice(flags);
    a.extend_from_slice(extra);
    let (code, out, err) = phalanx(&a);
    assert_eq!(code, 0, "{out}\n{err}");
}

/// Greedy generation of `n` tokens from `model`.
fn greedy(model: &std::path::Path, prompt: &str, n: usize) -> String {
    let n = n.to_string();
    let (code, out, err) = phalanx(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--tokens",
        &n,
        "--temperature",
        "0",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    out
}

const LLAMA: &[&str] = &[
    "--set",
    "model.arch=llama",
    "--set",
    "model.n_layer=2",
    "--set",
    "model.n_head=4",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.intermediate_size=48",
    "--set",
    "model.block_size=32",
    "--set",
    "train.micro_batch_size=4",
    "--set",
    "train.eval_interval=0",
    "--set",
    "log.plot=\"\"",
    "--set",
    "log.report=\"\"",
];

#[test]
fn a_tensor_parallel_checkpoint_generates_as_the_whole_model() {
    let d = fresh_dir("phalanx-generate", "tp");
    // Llama, kv heads split (2 kv heads, tp 2) and replicated (1, tp 2);
    // GPT-2 under tp 2.
    let kv2 = ["--set", "model.n_kv_head=2", "--set", "parallel.tp=2"];
    let kv1 = ["--set", "model.n_kv_head=1", "--set", "parallel.tp=2"];
    let gpt = ["--set", "parallel.tp=2"];
    let cases: [(&str, &[&str], &[&str]); 3] = [
        ("llama-kv-split", LLAMA, &kv2),
        ("llama-kv-replicated", LLAMA, &kv1),
        ("gpt2", SMALL, &gpt),
    ];
    for (name, flags, extra) in cases {
        let ck = d.join(format!("{name}-ck"));
        let full = d.join(format!("{name}-full"));
        let full_file = full.join("model.safetensors");
        // GPT-2 saves one file; Llama a directory.
        let save = if name == "gpt2" { &full_file } else { &full };
        train_tp(flags, extra, &ck, save);
        let from_ck = greedy(&ck, "In the", 30);
        let from_full = greedy(save, "In the", 30);
        assert!(
            from_ck.starts_with("In the") && from_ck.trim_end().len() > "In the".len(),
            "{name}: {from_ck}"
        );
        assert_eq!(
            from_ck, from_full,
            "{name}: the tp checkpoint and the gathered model generate alike"
        );
        // The checkpoint's own step directory too.
        assert_eq!(greedy(&ck.join("step-00000003"), "In the", 30), from_full);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A word-level `tokenizer.json` of 6 words (ids 0-5, 0 unknown).
const TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "unk_token": "[UNK]",
            "vocab": {"[UNK]": 0, "in": 1, "the": 2, "beginning": 3, "god": 4, "created": 5}}
}"#;

#[test]
fn data_tokenizer_names_a_tokenizer_json() {
    let d = fresh_dir("phalanx-generate", "tokjson");
    let tj = d.join("tok").join("tokenizer.json");
    std::fs::create_dir_all(tj.parent().unwrap()).unwrap();
    std::fs::write(&tj, TOKENIZER).unwrap();
    let text = d.join("text.txt");
    std::fs::write(&text, "in the beginning god created the\n".repeat(300)).unwrap();
    let model = d.join("model");
    let ck = d.join("ck");
    let tok_set = format!("data.tokenizer=\"{}\"", tj.display());
    let data_set = format!("data.path=\"{}\"", text.display());
    let ck_set = format!("checkpoint.dir=\"{}\"", ck.display());
    let sets = |vocab: &'static str| {
        let mut a: Vec<String> = vec!["train".into(), "--nproc-per-node".into(), "2".into()];
        a.extend(LLAMA.iter().map(|s| s.to_string()));
        for s in [
            vocab,
            "model.block_size=12",
            "train.steps=40",
            "optim.lr=0.01",
            "checkpoint.interval=40",
            &tok_set,
            &data_set,
            &ck_set,
        ] {
            a.extend(["--set".to_string(), s.to_string()]);
        }
        a
    };
    // The text file is encoded with the tokenizer.json: 1800 tokens.
    let mut a = sets("model.vocab_size=6");
    a.extend(["--save-final".into(), model.to_str().unwrap().into()]);
    let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
    let (code, out, err) = phalanx(&a);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("({} tokenizer)", tj.display())) && out.contains("tokens"),
        "{out}"
    );
    let train_tokens: usize = out
        .split(" train / ")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no token count in {out}"));
    assert!(
        (1700..=1800).contains(&train_tokens),
        "6-word sentences, 300 times, 2% held out: {out}"
    );
    // The tokenizer is saved beside the weights, and generation reads it:
    // the model has learned the sentence.
    assert_eq!(
        std::fs::read_to_string(model.join("tokenizer.json")).unwrap(),
        TOKENIZER
    );
    let g = greedy(&model, "in the beginning", 3);
    assert!(g.contains("god created the"), "{g}");
    // From the checkpoint, whose config names the tokenizer.json.
    let g = greedy(&ck, "in the beginning", 3);
    assert!(g.contains("god created the"), "{g}");
    // A downloaded model's directory (its config.json records no
    // tokenizer, one sits beside the weights) imported with from-hf: the
    // checkpoint keeps that tokenizer, not the byte one.
    let hf = d.join("downloaded");
    std::fs::create_dir_all(&hf).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(model.join(f), hf.join(f)).unwrap();
    }
    let mut cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    cj.as_object_mut().unwrap().remove("phalanx_tokenizer");
    std::fs::write(hf.join("config.json"), cj.to_string()).unwrap();
    let imported = d.join("imported");
    let (code, out, err) = phalanx(&[
        "checkpoint",
        "from-hf",
        hf.to_str().unwrap(),
        imported.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let g = greedy(&imported, "in the beginning", 3);
    assert!(g.contains("god created the"), "{g}");
    // Converting a checkpoint whose tokenizer.json has gone is refused
    // before any weight is written (it is copied beside them last).
    let moved = d.join("tok").join("moved.json");
    std::fs::rename(&tj, &moved).unwrap();
    let conv = d.join("conv");
    let (code, out, err) = phalanx(&[
        "checkpoint",
        "convert",
        ck.to_str().unwrap(),
        conv.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("no such tokenizer.json"), "{err}");
    assert!(
        !conv.join("model.safetensors").exists() && !conv.join("config.json").exists(),
        "nothing written"
    );
    std::fs::rename(&moved, &tj).unwrap();

    // A resume over the same paths with another tokenizer.json (two ids
    // swapped), or with the text changed, is refused by name: it would
    // train on other tokens.
    let resume = |extra: &str| {
        let mut a = sets("model.vocab_size=6");
        a.extend(["--resume".into(), ck.to_str().unwrap().into()]);
        a.extend(["--set".into(), "train.steps=41".into()]);
        a.extend(["--set".into(), extra.into()]);
        let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        phalanx(&a)
    };
    let ck_out = format!("checkpoint.dir=\"{}\"", d.join("ck2").display());
    std::fs::write(
        &tj,
        TOKENIZER.replace("\"god\": 4, \"created\": 5", "\"god\": 5, \"created\": 4"),
    )
    .unwrap();
    let (code, out, err) = resume(&ck_out);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("data.tokenizer_content"), "{err}");
    std::fs::write(&tj, TOKENIZER).unwrap();
    std::fs::write(&text, "in the beginning created god the\n".repeat(300)).unwrap();
    let (code, out, err) = resume(&ck_out);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("data.content"), "{err}");
    std::fs::write(&text, "in the beginning god created the\n".repeat(300)).unwrap();
    let (code, out, err) = resume(&ck_out);
    assert_eq!(code, 0, "the same data resumes: {out}\n{err}");

    // Generation from the checkpoint with that tokenizer.json changed is
    // refused (it printed other words, silently); named explicitly, it is
    // used, with a warning.
    let swapped = TOKENIZER.replace("\"god\": 4, \"created\": 5", "\"god\": 5, \"created\": 4");
    std::fs::write(&tj, &swapped).unwrap();
    let gen_with = |prompt: &str, temperature: &str, extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--model",
            ck.to_str().unwrap(),
            "--prompt",
            prompt,
        ];
        a.extend_from_slice(&["--tokens", "2", "--temperature", temperature]);
        a.extend_from_slice(extra);
        phalanx(&a)
    };
    let gen = |extra: &[&str]| gen_with("in the", "0", extra);
    let (code, out, err) = gen(&[]);
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("is not the tokenizer.json"), "{err}");
    let (code, out, err) = gen(&["--set", &tok_set]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        err.contains("warning:") && err.contains("is not the tokenizer.json"),
        "{err}"
    );
    std::fs::write(&tj, TOKENIZER).unwrap();
    // A relative tokenizer path that is not there says how it is read.
    let (code, _, err) = gen(&["--set", "data.tokenizer=\"nope/tokenizer.json\""]);
    assert_eq!(code, 1);
    assert!(
        err.contains("a relative path is read from the current directory"),
        "{err}"
    );
    // A prompt that encodes to nothing, with no end-of-text token to start
    // from, names --prompt; a negative temperature reaches its check.
    let (code, _, err) = gen_with("", "0", &[]);
    assert_eq!(code, 1);
    assert!(err.contains("--prompt \"\" encodes to no tokens"), "{err}");
    let (code, _, err) = gen_with("in the", "-1", &[]);
    assert_eq!(code, 1);
    assert!(err.contains("--temperature must be a number >= 0"), "{err}");

    // A model vocabulary smaller than the tokenizer's is named.
    let a = sets("model.vocab_size=4");
    let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
    let (code, out, err) = phalanx(&a);
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("has a vocabulary of 6 tokens, more than model.vocab_size = 4"),
        "{err}"
    );
    // A tokenizer.json that is not there is named too.
    let missing = d.join("nope").join("tokenizer.json");
    let (code, _, err) = phalanx(&[
        "train",
        "--nproc-per-node",
        "1",
        "--set",
        "model.arch=llama",
        "--set",
        &format!("data.tokenizer=\"{}\"", missing.display()),
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains(&format!("{}: no such tokenizer.json", missing.display())),
        "{err}"
    );
    // Neither a name nor a .json path.
    let (code, _, err) = phalanx(&["train", "--set", "data.tokenizer=bpe"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("or the path of a Hugging Face tokenizer.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// A model whose vocabulary is larger than its tokenizer's (the byte
/// tokenizer's 256 ids on a model of 512) samples only ids the tokenizer
/// can decode: an id it cannot would end the printed text there.
#[test]
fn ids_past_the_tokenizers_vocabulary_are_never_sampled() {
    let d = fresh_dir("phalanx-generate", "padded-vocab");
    let model = d.join("model");
    let (code, out, err) = phalanx(&[
        "train",
        "--nproc-per-node",
        "1",
        "--set",
        "model.vocab_size=512",
        "--set",
        "model.n_layer=1",
        "--set",
        "train.steps=1",
        "--set",
        "train.eval_interval=0",
        "--set",
        "log.plot=\"\"",
        "--set",
        "log.report=\"\"",
        "--save-final",
        model.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    // One step from random weights: ids above 255 hold half the
    // probability, so before the fix the text ended within a few tokens.
    let (code, out, err) = phalanx(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "The ",
        "--tokens",
        "64",
        "--temperature",
        "1",
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    let text = out.trim_end_matches('\n');
    let gained = text.chars().count() - "The ".len();
    assert!(
        gained >= 16,
        "64 byte tokens printed {gained} characters: {out:?}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Weights holding NaN give NaN logits: an error, not an arbitrary token
/// (a NaN sorted first made every weight NaN, and the last candidate won).
#[test]
fn logits_that_are_not_finite_are_an_error() {
    let d = fresh_dir("phalanx-generate", "nan-logits");
    let model = d.join("model.safetensors");
    let (code, out, err) = phalanx(&[
        "train",
        "--nproc-per-node",
        "1",
        "--set",
        "model.n_layer=1",
        "--set",
        "train.steps=1",
        "--set",
        "train.eval_interval=0",
        "--set",
        "log.plot=\"\"",
        "--set",
        "log.report=\"\"",
        "--save-final",
        model.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    // Output into a pipe its reader closed (`| head -c 1`): the end, not a
    // panic (exit 101).
    let mut child = std::process::Command::new(common::BIN)
        .args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "400",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let dev = candle_core::Device::Cpu;
    let mut t = candle_core::safetensors::load(&model, &dev).unwrap();
    let ln = t.get("transformer.ln_f.weight").unwrap();
    let nan = candle_core::Tensor::full(f32::NAN, ln.shape(), &dev).unwrap();
    t.insert("transformer.ln_f.weight".into(), nan);
    candle_core::safetensors::save(&t, &model).unwrap();
    for temperature in ["0", "0.8"] {
        let (code, out, err) = phalanx(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "4",
            "--temperature",
            temperature,
        ]);
        assert_eq!(code, 1, "{out}\n{err}");
        assert!(err.contains("logits are not finite"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
