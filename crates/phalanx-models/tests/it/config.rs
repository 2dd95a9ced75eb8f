//! GPT-2's `model` section of a training config: presets, precedence
//! (defaults <- preset <- file <- --set), errors naming `model.KEY`, and
//! `to_toml()` round trips.

use phalanx_models::gpt2::config::{self, Gpt2Section};

fn sets(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

fn tmp(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("phalanx-models-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn presets_and_precedence() {
    let c = config::build(None, &[]).unwrap();
    let m = Gpt2Section::of(&c).unwrap();
    assert_eq!(m, Gpt2Section::preset("gpt-tiny").unwrap());
    assert_eq!(
        (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size),
        (4, 4, 128, 256, 128)
    );
    assert_eq!(c.seq_len(), Some(128));
    assert_eq!(c.model_facts().n_layer, Some(4));
    for (name, shape) in [
        ("gpt-10m", (6, 6, 384, 256, 256)),
        ("gpt-50m", (8, 12, 768, 256, 256)),
        ("gpt2-124m", (12, 12, 768, 50257, 1024)),
    ] {
        let c = config::build(None, &sets(&[&format!("model.preset={name}")])).unwrap();
        let m = Gpt2Section::of(&c).unwrap();
        assert_eq!(
            (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size),
            shape
        );
        assert_eq!(m.preset, name);
    }
    // The file's preset, its explicit key over the preset, --set over the file.
    let p = tmp(
        "m.toml",
        "[model]\npreset = \"gpt-10m\"\nn_layer = 3\nn_head = 4\n",
    );
    let c = config::build(Some(&p), &sets(&["model.n_head=2"])).unwrap();
    let m = Gpt2Section::of(&c).unwrap();
    assert_eq!(
        (m.preset.as_str(), m.n_layer, m.n_head, m.n_embd),
        ("gpt-10m", 3, 2, 384)
    );
    // --set's preset wins over the file's; the file's explicit keys still apply.
    let c = config::build(Some(&p), &sets(&["model.preset=gpt-tiny"])).unwrap();
    let m = Gpt2Section::of(&c).unwrap();
    assert_eq!(
        (m.preset.as_str(), m.n_layer, m.n_head, m.n_embd),
        ("gpt-tiny", 3, 4, 128)
    );
}

#[test]
fn to_toml_round_trips() {
    let c = config::build(
        None,
        &sets(&[
            "model.preset=gpt-10m",
            "model.n_layer=2",
            "data.tokenizer=gpt2",
        ]),
    )
    .unwrap();
    let t = c.to_toml();
    // The section's keys are written in name order.
    let want = "[model]\nblock_size = 256\nn_embd = 384\nn_head = 6\nn_layer = 2\n\
                preset = \"gpt-10m\"\nvocab_size = 256\n";
    assert!(t.contains(want), "{t}");
    let back = config::build(Some(&tmp("rt.toml", &t)), &[]).unwrap();
    assert_eq!(back, c);
}

#[test]
fn errors_name_the_key() {
    let e = |s: &[&str]| config::build(None, &sets(s)).unwrap_err().to_string();
    assert!(e(&["model.n_layers=2"]).contains("unknown key `model.n_layers`"));
    assert!(e(&["model.n_layer=\"two\""]).contains("`model.n_layer` expects an integer"));
    assert!(e(&["model.preset=gpt-huge"]).contains("unknown model.preset \"gpt-huge\""));
    assert!(
        e(&["model.n_head=3"]).contains("model.n_embd (128) must be divisible by model.n_head (3)")
    );
    assert!(e(&["model.block_size=0"]).contains("model sizes must be positive"));
    // The library alone has no model section.
    let l = phalanx::config::TrainConfig::build(None, &sets(&["model.n_layer=2"]));
    assert!(l
        .unwrap_err()
        .to_string()
        .contains("unknown key `model.n_layer`"));
}
