//! What `data.path` may name for a model's loader (`common::data`): with a
//! `tokenizer.json`, one text file is read whole, so a FIFO (which would
//! hang the read) or a device such as `/dev/zero` (which would fill the
//! memory) is refused naming it, before it is opened.

use phalanx::config::TrainConfig;
use phalanx_models::common::data::open_data_for;
use std::path::Path;

/// A word-level `tokenizer.json` of 6 words (ids 0-5, 0 unknown).
const TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "unk_token": "[UNK]",
            "vocab": {"[UNK]": 0, "in": 1, "the": 2, "beginning": 3, "god": 4, "created": 5}}
}"#;

#[test]
fn a_text_path_that_is_not_a_regular_file_is_refused_with_a_tokenizer() {
    let d = phalanx::fsutil::ScratchDir::new("phalanx-models", "data-nonregular");
    let tj = d.join("tokenizer.json");
    std::fs::write(&tj, TOKENIZER).unwrap();
    let fifo = d.join("fifo.txt");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let text = d.join("text.txt");
    std::fs::write(&text, "in the beginning god created the\n".repeat(200)).unwrap();
    let cfg_for = |p: &Path| {
        TrainConfig::build(
            None,
            &[
                format!("data.path=\"{}\"", p.display()),
                format!("data.tokenizer=\"{}\"", tj.display()),
            ],
        )
        .unwrap()
    };
    for p in [Path::new("/dev/zero"), fifo.as_path()] {
        let e = match open_data_for(&cfg_for(p), 8, 64) {
            Ok(_) => panic!("{} must be refused", p.display()),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("not a regular file") && e.contains(p.to_str().unwrap()),
            "{e}"
        );
    }
    // A regular file reads.
    let l = open_data_for(&cfg_for(&text), 8, 64).unwrap();
    assert!(l.train_samples() > 0);
}
