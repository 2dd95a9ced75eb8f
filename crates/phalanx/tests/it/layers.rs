//! The library's modules form layers: each top-level module of
//! `crates/phalanx/src` uses only modules of lower layers (`crate::X` in
//! code, not in comments), so no import runs back up and no cycle crosses
//! modules. A new module, or an import that breaks the order, fails here.

use std::collections::BTreeMap;
use std::path::Path;

/// Bottom first. A module may use the modules of earlier layers only.
const LAYERS: &[&[&str]] = &[
    // Reading and writing files within bounds: std only.
    &["fsutil"],
    &["data", "device", "fault", "ledger", "ops", "precision"],
    &["placement"],
    &["config"],
    &["error"],
    // Collectives on candle tensors: what the parallel layers and the
    // strategies reduce on a device.
    &["collective"],
    &["engine", "mesh", "monitor", "plan", "report", "tp"],
    &["optim"],
    &["strategy"],
    &["checkpoint"],
    &["trainer"],
];

/// Macros exported at the crate root, by the module that defines them.
const MACROS: &[(&str, &str)] = &[("simd_dispatch", "ops")];

/// `crate::X` paths in the code of one file (comment lines skipped).
fn uses(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let code = code.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let name: String = rest[i + 7..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
            rest = &rest[i + 7..];
        }
    }
    out
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_use_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layer: BTreeMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(k, ms)| ms.iter().map(move |m| (*m, k)))
        .collect();
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut bad = Vec::new();
    for p in all {
        let rel = p.strip_prefix(&src).unwrap();
        let top = rel.iter().next().unwrap().to_str().unwrap();
        let top = top.strip_suffix(".rs").unwrap_or(top);
        if top == "lib" {
            continue;
        }
        let Some(&mine) = layer.get(top) else {
            bad.push(format!("module `{top}` has no layer in tests/layers.rs"));
            continue;
        };
        for used in uses(&std::fs::read_to_string(&p).unwrap()) {
            let used = MACROS
                .iter()
                .find(|(m, _)| *m == used)
                .map_or(used.clone(), |(_, owner)| owner.to_string());
            match layer.get(used.as_str()) {
                Some(&l) if l < mine || used == top => {}
                Some(_) => bad.push(format!(
                    "{} (layer {mine}) uses crate::{used} (not below it)",
                    rel.display()
                )),
                // Re-exports at the crate root (`crate::Result`, `crate::Error`).
                None if ["Result", "Error"].contains(&used.as_str()) && mine > layer["error"] => {}
                None => bad.push(format!("{} uses crate::{used}", rel.display())),
            }
        }
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_check_sees_an_import_that_runs_up() {
    assert_eq!(
        uses("use crate::trainer::x; // crate::no\n// crate::nor\nlet a = crate::fault::at_step;"),
        vec!["trainer", "fault"]
    );
}
