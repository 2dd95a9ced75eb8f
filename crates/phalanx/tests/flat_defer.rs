//! `FlatBuffer::defer_to`: values left on the device until the host reads
//! them, then read back once; every way in reads them, and changes count.

use candle_core::{Device, Tensor};
use phalanx::engine::backend::ParamSource;
use phalanx::engine::flat::deferred_reads;
use phalanx::engine::{FlatBuffer, Layout, ParamDecl};
use phalanx::ledger::{Ledger, Mem};

/// The read counter is process-wide: tests that count take turns.
static COUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn layout() -> Layout {
    Layout::new(vec![
        vec![ParamDecl::new("a", &[2, 2])],
        vec![ParamDecl::new("b", &[3])],
    ])
    .unwrap()
}

#[test]
fn deferred_values_are_read_back_once_when_first_read() {
    let _turn = COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let l = layout();
    let mut flat = FlatBuffer::from_vec(&l, &Ledger::new(), Mem::Params, vec![0.0; 7]);
    let v0 = flat.version();
    let t = Tensor::from_vec(
        (1..=7).map(|x| x as f32).collect::<Vec<_>>(),
        7,
        &Device::Cpu,
    )
    .unwrap();
    flat.defer_to(vec![(0, t.clone())]).unwrap();
    assert!(flat.is_deferred());
    assert_ne!(flat.version(), v0, "deferring is a change");
    assert_eq!(flat.len(), 7, "the length needs no read");
    let before = deferred_reads();
    // Read through a block: the whole buffer comes back, once.
    assert_eq!(flat.block_params(1).unwrap(), &[5.0, 6.0, 7.0]);
    assert!(!flat.is_deferred());
    assert_eq!(flat.as_slice(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!(deferred_reads(), before + 1);
}

#[test]
fn a_mutable_borrow_reads_back_first_and_the_latest_values_win() {
    let _turn = COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let l = layout();
    let mut flat = FlatBuffer::from_vec(&l, &Ledger::new(), Mem::Params, vec![9.0; 7]);
    let t = Tensor::zeros(7, candle_core::DType::F32, &Device::Cpu).unwrap();
    flat.defer_to(vec![(0, t.clone())]).unwrap();
    // The device tensor changes after it was handed over (an optimizer
    // stepping on it in place): the read sees the change.
    t.slice_set(&Tensor::new(&[3.0f32], &Device::Cpu).unwrap(), 0, 2)
        .unwrap();
    let s = flat.as_mut_slice();
    assert_eq!(s[..4], [0.0, 0.0, 3.0, 0.0]);
    s[0] = 1.0;
    assert_eq!(flat.as_slice()[0], 1.0);
    // Reads from many threads at once: one read back, all see the values.
    let u = Tensor::ones(7, candle_core::DType::F32, &Device::Cpu).unwrap();
    flat.defer_to(vec![(0, u)]).unwrap();
    let before = deferred_reads();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| assert_eq!(flat.as_slice(), &[1.0; 7]));
        }
    });
    assert_eq!(deferred_reads(), before + 1);
}

#[test]
fn a_tensor_of_another_shape_or_a_partly_held_buffer_is_refused() {
    let l = layout();
    let mut flat = FlatBuffer::from_vec(&l, &Ledger::new(), Mem::Params, vec![0.0; 7]);
    let short = Tensor::zeros(6, candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(flat.defer_to(vec![(0, short)]).is_err());
    let halves = Tensor::zeros(7, candle_core::DType::F16, &Device::Cpu).unwrap();
    assert!(flat.defer_to(vec![(0, halves)]).is_err());
    let first = 0..4;
    flat.hold_only(std::slice::from_ref(&first));
    let whole = Tensor::zeros(7, candle_core::DType::F32, &Device::Cpu).unwrap();
    let e = flat.defer_to(vec![(0, whole)]).unwrap_err();
    assert!(e.to_string().contains("held"), "{e}");
    assert!(!flat.is_deferred());
}

#[test]
fn pieces_of_any_shape_cover_the_buffer_in_order() {
    let l = layout();
    let mut flat = FlatBuffer::from_vec(&l, &Ledger::new(), Mem::Params, vec![0.0; 7]);
    let a = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap(); // (2, 2)
    let b = Tensor::new(&[5.0f32, 6.0, 7.0], &Device::Cpu).unwrap();
    // Out of order, or leaving a gap, is refused.
    assert!(flat.defer_to(vec![(4, b.clone()), (0, a.clone())]).is_err());
    assert!(flat.defer_to(vec![(0, a.clone())]).is_err());
    flat.defer_to(vec![(0, a), (4, b)]).unwrap();
    assert_eq!(flat.as_slice(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
}

#[test]
fn the_kept_copies_flattened_carry_no_graph() {
    use phalanx::engine::resident::Resident;
    let l = layout();
    let ledger = Ledger::new();
    let flat = FlatBuffer::from_vec(&l, &ledger, Mem::Params, (0..7).map(|x| x as f32).collect());
    let kept = Resident::new(&ledger);
    for (k, p) in l.params().iter().enumerate() {
        let data = &flat.as_slice()[p.range()];
        let v = kept.get(k, p, &flat, data, &Device::Cpu).unwrap().unwrap();
        assert!(v.as_tensor().track_op(), "a kept copy is a variable");
    }
    // What an optimizer computes from the flat copy must not hold a graph
    // back to the variables: step after step it would keep every step's
    // tensors alive.
    let f = kept.flat(&flat, l.params(), 0..7).unwrap().unwrap();
    assert!(!f.track_op());
    assert_eq!(
        f.to_vec1::<f32>().unwrap(),
        (0..7).map(|x| x as f32).collect::<Vec<_>>()
    );
    // Changed since: none.
    let mut flat = flat;
    flat.as_mut_slice()[0] = 1.0;
    assert!(kept.flat(&flat, l.params(), 0..7).unwrap().is_none());
}
