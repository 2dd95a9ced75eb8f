//! Files written whole: while a large file is being written no named
//! temporary exists beside it (a process killed at any moment of the write
//! leaves nothing), and the result has the umask's permissions.

use std::time::{Duration, Instant};

#[test]
fn no_named_temporary_exists_while_writing() {
    let d = std::env::temp_dir().join(format!("phalanx-fsutil-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let target = d.join("model.safetensors");
    let bytes = vec![7u8; 256 << 20];
    let t = target.clone();
    let writer = std::thread::spawn(move || phalanx::fsutil::write_atomic(&t, &bytes));
    let t0 = Instant::now();
    let mut looks = 0;
    while !writer.is_finished() && t0.elapsed() < Duration::from_secs(60) {
        let names: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        // Only the final link-and-rename (microseconds) may show a name.
        if !names.is_empty() && !writer.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
            if !writer.is_finished() {
                let again: Vec<String> = std::fs::read_dir(&d)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                    .filter(|n| n != "model.safetensors")
                    .collect();
                assert!(
                    again.is_empty(),
                    "a named temporary during the write: {again:?}"
                );
            }
        }
        looks += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    writer.join().unwrap().unwrap();
    assert!(looks > 3, "the write was too fast to watch ({looks} looks)");
    assert_eq!(std::fs::metadata(&target).unwrap().len(), 256 << 20);
    let names: Vec<_> = std::fs::read_dir(&d).unwrap().collect();
    assert_eq!(names.len(), 1, "only the file itself");
    let _ = std::fs::remove_dir_all(&d);
}
